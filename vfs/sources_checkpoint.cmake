# Checkpoint format (manifest, virtual-file layout), restore and export. Owned by the mount work.
list(APPEND OPTSTATE_VFS_SOURCES checkpoint.cc restore.cc export.cc)
