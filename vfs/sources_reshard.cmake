# Resharding: N ranks' checkpoints -> M ranks' (box geometry, layout JSON, streaming copy).
list(APPEND OPTSTATE_VFS_SOURCES reshard.cc)
