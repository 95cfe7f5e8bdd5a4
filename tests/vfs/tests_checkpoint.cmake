# Checkpoint format, restore and export tests. Owned by the mount work.
list(APPEND OPTSTATE_VFS_TEST_SOURCES checkpoint_format_test.cc checkpoint_restore_test.cc checkpoint_export_test.cc
     checkpoint_fuzz_replay_test.cc)

# libFuzzer target for the manifest parser: clang only. The parser's source is
# compiled into the target so that it carries the fuzzer's coverage.
if(CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
  add_executable(manifest_fuzz ${CMAKE_CURRENT_SOURCE_DIR}/fuzz/manifest_fuzz.cc
                 ${CMAKE_SOURCE_DIR}/vfs/checkpoint.cc)
  target_compile_options(manifest_fuzz PRIVATE -fsanitize=fuzzer,address,undefined)
  target_link_options(manifest_fuzz PRIVATE -fsanitize=fuzzer,address,undefined)
  target_link_libraries(manifest_fuzz PRIVATE optstate_vfs nlohmann_json::nlohmann_json
                        PkgConfig::XXHASH)
endif()
