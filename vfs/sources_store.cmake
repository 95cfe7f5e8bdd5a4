# The store: index, generations, snapshots, GC, chunk I/O over the io engines.
list(APPEND OPTSTATE_VFS_SOURCES
  store.cc
  checksum.cc
  internal/chunk_hasher.cc
  crash_point.cc
  internal/store_format.cc
  internal/rocks_util.cc)
