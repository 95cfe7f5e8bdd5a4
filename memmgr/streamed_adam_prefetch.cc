// StreamedAdam: Prefetch, which reads the next step's state into the host
// cache tier or staging buffers while the trainer runs forward/backward.
#include "memmgr/internal/streamed_engine.h"

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "memmgr/internal/committer.h"
#include "memmgr/internal/engine_memory.h"
#include "memmgr/internal/slice_layout.h"
#include "memmgr/internal/step_pipeline.h"
#include "memmgr/internal/prefetcher.h"
#include "memmgr/internal/streamed_adam_util.h"
#include "base/log.h"

namespace optstate::memmgr::internal {


Status StreamedEngine::Prefetch() {
  OPTSTATE_RETURN_IF_ERROR(CheckUsable());
  // During a step the step itself is reading; a prefetch already runs.
  if (step_.in_step() || prefetcher_->running()) return Status::Ok();
  internal::EngineMemory* impl = mem_;
  const MemoryManagerOptions& mo = impl->options();
  // Chunks outside the tier go into staging buffers for the step's pipeline
  // to adopt: at most its own staging less one slice (SlicePipeline::Begin).
  size_t stage_limit = 0;
  if (!CacheHoldsState() && !prefetcher_->has_staged()) {
    const size_t slice_bufs = MaxSliceSize().chunks;
    const size_t want = internal::StepPipelineBuffers(impl->staging_count(), mo, MaxSliceSize());
    stage_limit = want > slice_bufs ? want - slice_bufs : 0;
  }
  if (!impl->cache()->enabled() && stage_limit == 0) return Status::Ok();
  if (!committer_->running()) OPTSTATE_RETURN_IF_ERROR(EnsureIo());  // else the commit's thread owns io_ (it exists)
  // The last step's order, else every param's.
  std::vector<StepOrderEntry> order = step_.order;
  if (order.empty()) {
    for (const auto& [name, p] : params_.all()) {
      if (!params_.retired(name)) {
        order.push_back(StepOrderEntry{p.info.id, p.rule, p.fields, p.info.numel});
      }
    }
  }
  prefetcher_->Start(io_.get(), /*after_commit=*/committer_->running(), stage_limit, std::move(order));
  return Status::Ok();
}

}  // namespace optstate::memmgr::internal
