// A frozen generation of a store (vfs/store.h GenerationView): its tensors
// and chunk versions, plus the lease that keeps them from GC (released when the
// last holder, a GenerationView or a ChunkIo of it, goes). Internal to vfs/.
#pragma once

#include <memory>
#include <string>

#include "vfs/internal/store_core.h"

namespace optstate::vfs::internal {

// A frozen generation: its tensors and chunk versions, plus the lease that
// keeps them (released when the last holder goes).
struct ViewData {
  std::shared_ptr<Core> core;
  GenerationInfo info;
  std::vector<TensorInfo> tensors;        // sorted by name
  std::map<uint32_t, TensorInfo> by_id;
  std::map<Key, Version> chunks;          // written chunks only
  std::string lease_file;                 // read-only stores: the lease file
  std::unique_ptr<File> lease_handle;     // open, flock'ed: the lease is alive
  bool in_process_ref = false;            // writable stores: Core::view_refs_

  ~ViewData() {
    if (in_process_ref) {
      MutexLock l(&core->mu());
      core->DropViewRef(info.generation);
    }
    if (!lease_file.empty()) (void)core->fs()->Remove(lease_file);
    lease_handle.reset();  // after the removal: never an unlocked lease file the writer could misjudge
  }
};


// Builds the frozen view of generation g. mu_ held.
std::shared_ptr<ViewData> BuildView(const std::shared_ptr<Core>& core, uint64_t g);

// The GenerationView over v, and back: the data of a view made here.
std::unique_ptr<GenerationView> NewGenerationView(std::shared_ptr<ViewData> v);
const ViewData& ViewDataOf(const GenerationView& view);

// Leases generation `generation` (kLatest: the newest) or, when `snapshot` is
// not empty, that snapshot's generation, and returns its view: in-process
// reference for a writer; for a read-only store a lease file, checked against
// RETAINED under the shared lease flock (store_leases.cc).
Result<std::unique_ptr<GenerationView>> OpenGenerationView(const std::shared_ptr<Core>& core, uint64_t generation,
                                                           const std::string& snapshot);

}  // namespace optstate::vfs::internal
