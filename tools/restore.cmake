# optstate-restore (included from tools/CMakeLists.txt).
add_executable(optstate-restore ${CMAKE_CURRENT_SOURCE_DIR}/optstate_restore.cc)
target_link_libraries(optstate-restore PRIVATE optstate_tools_internal optstate_vfs CLI11::CLI11
                      fmt::fmt)
set_target_properties(optstate-restore PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tools)
