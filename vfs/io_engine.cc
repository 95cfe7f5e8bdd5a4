#include "vfs/io_engine.h"

#include "vfs/internal/sync_io_engine.h"
#include "vfs/internal/uring_io_engine.h"

namespace optstate::vfs {

Result<std::unique_ptr<IoEngine>> IoEngine::NewUring(const IoEngineOptions& opts) {
  return internal::UringIoEngine::Create(opts);
}

Result<std::unique_ptr<IoEngine>> IoEngine::NewSync(uint64_t staging_bytes) {
  return internal::SyncIoEngine::Create(staging_bytes);
}

}  // namespace optstate::vfs
