# optstate-reshard (included from tools/CMakeLists.txt).
add_executable(optstate-reshard ${CMAKE_CURRENT_SOURCE_DIR}/optstate_reshard.cc)
target_link_libraries(optstate-reshard PRIVATE optstate_tools_internal optstate_vfs CLI11::CLI11 fmt::fmt)
set_target_properties(optstate-reshard PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tools)
