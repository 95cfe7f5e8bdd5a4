// StreamedAdam: the public optimizer over its engine (internal/
// streamed_engine.h); every call is the engine's.
#include "memmgr/streamed_adam.h"

#include <memory>
#include <utility>

#include "memmgr/internal/streamed_engine.h"

namespace optstate::memmgr {

using internal::StreamedEngine;

StreamedAdam::StreamedAdam(std::unique_ptr<StreamedEngine> engine) : engine_(std::move(engine)) {}
StreamedAdam::~StreamedAdam() = default;

Result<std::unique_ptr<StreamedAdam>> StreamedAdam::Create(vfs::Store* store, MemoryManager* mm,
                                                          const StreamedAdamOptions& opts) {
  return Create(store, mm, opts, std::unique_ptr<UpdateRule>());
}

Result<std::unique_ptr<StreamedAdam>> StreamedAdam::Create(vfs::Store* store, MemoryManager* mm,
                                                          const StreamedAdamOptions& opts,
                                                          std::unique_ptr<UpdateRule> rule) {
  std::vector<std::unique_ptr<UpdateRule>> rules;
  rules.push_back(std::move(rule));
  return Create(store, mm, opts, std::move(rules));
}

Result<std::unique_ptr<StreamedAdam>> StreamedAdam::Create(vfs::Store* store, MemoryManager* mm,
                                                          const StreamedAdamOptions& opts,
                                                          std::vector<std::unique_ptr<UpdateRule>> rules) {
  OPTSTATE_ASSIGN_OR_RETURN(std::unique_ptr<StreamedEngine> e, StreamedEngine::Create(store, mm, opts, std::move(rules)));
  return std::unique_ptr<StreamedAdam>(new StreamedAdam(std::move(e)));
}

Status StreamedAdam::SetGroup(const ParamGroup& g) { return engine_->SetGroup(g); }
Result<ParamGroup> StreamedAdam::GetGroup(uint32_t id) const { return engine_->GetGroup(id); }
Status StreamedAdam::SetGroupHyperparams(uint32_t id, const Hyperparams& h) {
  return engine_->SetGroupHyperparams(id, h);
}
Result<Hyperparams> StreamedAdam::GetGroupHyperparams(uint32_t id) const { return engine_->GetGroupHyperparams(id); }

Status StreamedAdam::RegisterParam(const std::string& name, uint64_t numel, uint32_t group, const void* d_initial,
                                   std::optional<DType> initial_type, const ShardInfo& shard, uint32_t rule) {
  return engine_->RegisterParam(name, numel, group, d_initial, initial_type, shard, rule);
}
Status StreamedAdam::RegisterParams(std::span<const ParamSpec> specs, std::vector<bool>* existed) {
  return engine_->RegisterParams(specs, existed);
}
bool StreamedAdam::HasParam(const std::string& name) const { return engine_->HasParam(name); }
std::vector<std::string> StreamedAdam::ParamNames() const { return engine_->ParamNames(); }
std::vector<std::string> StreamedAdam::UnregisteredParams() const { return engine_->UnregisteredParams(); }
Status StreamedAdam::RetireParam(const std::string& name) { return engine_->RetireParam(name); }

Status StreamedAdam::Step(std::span<const ParamGrad> grads, const float* d_found_inf, const float* d_grad_scale) {
  return engine_->Step(grads, d_found_inf, d_grad_scale);
}
Status StreamedAdam::BeginStep(const float* d_found_inf, const float* d_grad_scale) {
  return engine_->BeginStep(d_found_inf, d_grad_scale);
}
Status StreamedAdam::StepParam(const ParamGrad& g) { return engine_->StepParam(g); }
Result<uint64_t> StreamedAdam::EndStep() { return engine_->EndStep(); }

Status StreamedAdam::SetGradScale(float grad_scale) { return engine_->SetGradScale(grad_scale); }
float StreamedAdam::grad_scale() const { return engine_->grad_scale(); }
Status StreamedAdam::LoadMainFrom(const std::string& name, const void* d_weights, DType type) {
  return engine_->LoadMainFrom(name, d_weights, type);
}
Result<uint64_t> StreamedAdam::MakeDurable() { return engine_->MakeDurable(); }
uint64_t StreamedAdam::uncommitted_steps() const { return engine_->uncommitted_steps(); }
Status StreamedAdam::WaitForCommit() { return engine_->WaitForCommit(); }
bool StreamedAdam::commit_in_flight() const { return engine_->commit_in_flight(); }
Status StreamedAdam::Prefetch() { return engine_->Prefetch(); }
bool StreamedAdam::prefetch_running() const { return engine_->prefetch_running(); }

uint64_t StreamedAdam::step_count(uint32_t group) const { return engine_->step_count(group); }
Result<uint64_t> StreamedAdam::param_step_count(const std::string& name) const {
  return engine_->param_step_count(name);
}
uint64_t StreamedAdam::last_generation() const { return engine_->last_generation(); }
bool StreamedAdam::last_step_skipped() const { return engine_->last_step_skipped(); }
uint64_t StreamedAdam::global_step() const { return engine_->global_step(); }
void StreamedAdam::set_global_step(uint64_t s) { engine_->set_global_step(s); }
const StreamedAdam::StepStats& StreamedAdam::last_step_stats() const { return engine_->last_step_stats(); }

}  // namespace optstate::memmgr
