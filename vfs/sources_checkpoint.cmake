# Checkpoint format (manifest, virtual-file layout) and restore. Owned by the mount work.
list(APPEND OPTSTATE_VFS_SOURCES checkpoint.cc restore.cc)
