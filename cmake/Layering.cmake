# optstate_check_layering(FOLDER ALLOWED): fails configure when a source file in
# FOLDER includes a header of one of our folders not listed in ALLOWED, or when
# a third-party header appears outside the folder that owns it, or when it
# includes another folder's internal/ headers (STYLE.md).
set(OPTSTATE_FOLDERS base vfs memmgr kernels mount tools capi)
function(optstate_check_layering folder allowed)
  file(GLOB_RECURSE srcs CONFIGURE_DEPENDS
       ${CMAKE_SOURCE_DIR}/${folder}/*.h ${CMAKE_SOURCE_DIR}/${folder}/*.cc
       ${CMAKE_SOURCE_DIR}/${folder}/*.cu ${CMAKE_SOURCE_DIR}/${folder}/*.cuh)
  foreach(src IN LISTS srcs)
    file(STRINGS ${src} lines REGEX "^[ \t]*#[ \t]*include[ \t]*[\"<]")
    foreach(line IN LISTS lines)
      foreach(other IN LISTS OPTSTATE_FOLDERS)
        if(line MATCHES "#[ \t]*include[ \t]*\"${other}/" AND NOT other STREQUAL folder)
          list(FIND allowed ${other} idx)
          if(idx EQUAL -1)
            message(FATAL_ERROR "layering: ${src} includes ${other}/ (${folder} may include: '${allowed}')")
          endif()
          if(line MATCHES "#[ \t]*include[ \t]*\"${other}/internal/")
            message(FATAL_ERROR "layering: ${src} includes ${other}/internal/: only ${other}/ may (use its public headers)")
          endif()
        endif()
      endforeach()
      # Third-party headers stay in the folder that owns them; base/, below
      # every folder, uses only the standard library, fmt and spdlog.
      if(folder STREQUAL "base" AND line MATCHES "#[ \t]*include[ \t]*<[^>]*[./]"
         AND NOT line MATCHES "#[ \t]*include[ \t]*<(fmt|spdlog)/")
        message(FATAL_ERROR "layering: ${src}: base/ may include only the standard library, fmt and spdlog")
      endif()
      if(line MATCHES "rocksdb/|liburing" AND NOT folder STREQUAL "vfs")
        message(FATAL_ERROR "layering: ${src}: RocksDB/liburing headers belong to vfs/ only")
      endif()
      if(line MATCHES "fuse" AND NOT folder STREQUAL "mount")
        message(FATAL_ERROR "layering: ${src}: libfuse headers belong to mount/ only")
      endif()
      if(line MATCHES "<cuda|<cu[a-z_]*\\.h" AND NOT folder STREQUAL "kernels"
         AND NOT src MATCHES "memmgr/internal/cuda_")
        message(FATAL_ERROR "layering: ${src}: CUDA headers belong to kernels/ and memmgr/internal/cuda_* only")
      endif()
    endforeach()
  endforeach()
endfunction()
