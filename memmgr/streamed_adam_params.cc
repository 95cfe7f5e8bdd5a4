// StreamedAdam: the params of a run: registration (new or restored), their
// initial weights, LoadMainFrom, retirement, and dropping registrations that
// no generation committed.
#include "memmgr/streamed_adam.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "memmgr/internal/manager_impl.h"
#include "memmgr/internal/step_pipeline.h"
#include "memmgr/internal/streamed_adam_impl.h"
#include "memmgr/internal/streamed_adam_util.h"
#include "base/log.h"

namespace optstate::memmgr {

using internal::CheckMomentFields;
using internal::Device;
using internal::DimsText;
using internal::ImplOf;
using internal::ManagerImpl;
using internal::NameList;
using internal::DTypeText;
using internal::ToFloat;
using internal::WithNote;

std::vector<std::string> StreamedAdam::UnregisteredParams() const {
  std::vector<std::string> out;
  if (!any_registered_) return out;
  for (const auto& [n, p] : params_) {
    if (!p.registered) out.push_back(n);
  }
  return out;
}

Status StreamedAdam::RetireParam(const std::string& name) {
  OPTSTATE_RETURN_IF_ERROR(CheckUsable());
  if (in_step_) return FailedPrecondition("StreamedAdam::RetireParam '" + name + "': a step is in progress");
  OPTSTATE_RETURN_IF_ERROR(FinishCommit());
  auto it = params_.find(name);
  if (it == params_.end()) {
    return NotFound("StreamedAdam::RetireParam: store " + store_->path() + " has no param '" + name + "'" +
                    (retired_.count(name) ? " (already retired in this run)" : ""));
  }
  if (it->second.registered || !it->second.committed) {
    return FailedPrecondition("StreamedAdam::RetireParam '" + name + "': registered in this run (store " +
                              store_->path() + "); only a param restored from the store and not registered can be "
                              "retired");
  }
  retired_.insert(name);
  params_.erase(it);
  OPTSTATE_LOG_INFO("StreamedAdam: param {} of store {} retired for this run; its state stays in the store unchanged",
                    name, store_->path());
  return Status::Ok();
}

Status StreamedAdam::CheckModelComplete() const {
  if (!any_registered_) return Status::Ok();
  std::vector<std::string> missing = UnregisteredParams();
  if (missing.empty()) return Status::Ok();
  return FailedPrecondition(
      "StreamedAdam: store " + store_->path() + " holds " + std::to_string(missing.size()) +
      " param(s) that this run did not register: " +
      NameList(missing.begin(), missing.end(), [&](const std::string& n) { return params_.at(n).info.numel; }) +
      "; register them (their stored state is kept) or RetireParam them (their state stays in the store, "
      "unchanged); nothing was stepped or committed");
}

Status StreamedAdam::CheckSameGeometry(const vfs::TensorInfo& t, const std::string& what, uint64_t numel,
                                       uint32_t group, std::optional<DType> initial_type,
                                       const ShardInfo& shard) const {
  auto mismatch = [&](const std::string& field, const std::string& stored, const std::string& given) {
    return InvalidArgument("StreamedAdam::RegisterParam '" + t.name + "': store " + store_->path() + " has " + what +
                           " with " + field + " " + stored + ", registered with " + field + " " + given +
                           " (the model no longer matches the store; nothing changed)");
  };
  if (t.numel != numel) return mismatch("numel", std::to_string(t.numel), std::to_string(numel));
  if (t.group != group) return mismatch("group", std::to_string(t.group), std::to_string(group));
  if (initial_type && t.dtype != *initial_type) {
    return mismatch("dtype", DTypeName(t.dtype), DTypeName(*initial_type));
  }
  // The same defaults as Store::CreateTensor.
  std::vector<uint64_t> shape = shard.shape.empty() ? std::vector<uint64_t>{numel} : shard.shape;
  std::vector<uint64_t> global = shard.global_shape.empty() ? shape : shard.global_shape;
  std::vector<uint64_t> offset =
      shard.shard_offset.empty() ? std::vector<uint64_t>(global.size(), 0) : shard.shard_offset;
  if (t.shape != shape) return mismatch("shape", DimsText(t.shape), DimsText(shape));
  if (t.global_shape != global) return mismatch("global shape", DimsText(t.global_shape), DimsText(global));
  if (t.shard_offset != offset) return mismatch("shard offset", DimsText(t.shard_offset), DimsText(offset));
  return CheckMomentFields(t, store_->path(), opts_.moment_dtype);
}

std::string StreamedAdam::DropUncommittedRegistrations() {
  std::vector<std::string> dropped, reloaded;
  std::map<std::string, uint64_t> numels;
  for (auto it = params_.begin(); it != params_.end();) {
    Param& p = it->second;
    if (!p.committed) {
      dropped.push_back(it->first);
      numels[it->first] = p.info.numel;
      ImplOf(*mm_)->cache()->EraseTensor(p.info.id);
      (void)ImplOf(*mm_)->DropTensor(p.info.id);
      dropped_.insert(it->first);
      tensor_counts_.erase(p.info.id);
      it = params_.erase(it);
      continue;
    }
    if (p.main_pending) {
      reloaded.push_back(it->first);
      p.main_pending = false;
      ImplOf(*mm_)->cache()->EraseTensor(p.info.id);
      (void)ImplOf(*mm_)->DropTensor(p.info.id);
    }
    ++it;
  }
  registrations_pending_ = false;
  std::string msg;
  if (!dropped.empty()) {
    msg = "the registration of " + std::to_string(dropped.size()) + " new param(s) not yet committed was dropped (" +
          NameList(dropped.begin(), dropped.end(), [&](const std::string& n) { return numels[n]; }) +
          "): register them again";
  }
  if (!reloaded.empty()) {
    msg += (msg.empty() ? "" : "; ") + std::string("the weights LoadMainFrom loaded into ") +
           NameList(reloaded.begin(), reloaded.end(), [](const std::string&) { return uint64_t{0}; }) +
           " were dropped (main is back at generation " + std::to_string(last_generation_) + "): load them again";
  }
  return msg;
}

Status StreamedAdam::AbortUncommitted(Status s) {
  Status a = store_->AbortPending();
  if (!a.ok()) OPTSTATE_LOG_ERROR("StreamedAdam: AbortPending after a failed write: {}", a.ToString());
  ImplOf(*mm_)->OnAbortPending();
  return WithNote(s, DropUncommittedRegistrations());
}

Status StreamedAdam::WriteMain(const Param& p, const void* d_src, DType type) {
  ManagerImpl* impl = ImplOf(*mm_);
  Device* dev = impl->device();
  const uint64_t chunk = impl->page_bytes();
  const uint64_t chunk_elems = chunk / 4;
  const uint64_t numel = p.info.numel;
  const uint64_t nchunks = (numel + chunk_elems - 1) / chunk_elems;
  const uint32_t src_size = DTypeSize(type);
  impl->cache()->EraseTensor(p.info.id);
  std::vector<void*> bufs = impl->AcquireStaging(1, 8);
  std::vector<char> bounce;
  if (dev->backend() == Backend::kCuda) bounce.resize(chunk_elems * src_size);
  Status ios = EnsureIo();
  if (!ios.ok()) {
    impl->ReleaseStaging(bufs);
    return ios.WithContext("StreamedAdam: writing main of " + p.info.name);
  }
  vfs::ChunkIo* io = io_.get();
  std::vector<void*> free_bufs = bufs;
  std::vector<vfs::ChunkCompletion> done;
  Status st;
  for (uint64_t c = 0; c < nchunks && st.ok(); ++c) {
    while (free_bufs.empty() && st.ok()) {
      done.clear();
      st = io->Reap(&done, 1);
      for (auto& d : done) {
        if (!d.status.ok() && st.ok()) st = d.status;
        free_bufs.push_back(reinterpret_cast<void*>(d.tag));
      }
    }
    if (!st.ok()) break;
    void* buf = free_bufs.back();
    free_bufs.pop_back();
    uint64_t first = c * chunk_elems, n = std::min(chunk_elems, numel - first);
    const char* src = static_cast<const char*>(d_src) + first * src_size;
    if (!bounce.empty()) {
      st = dev->CopyD2H(bounce.data(), src, n * src_size, nullptr);
      if (st.ok()) st = dev->SyncStream(nullptr);
      if (!st.ok()) break;
      src = bounce.data();
    }
    float* out = static_cast<float*>(buf);
    if (type == DType::kF32) {
      std::memcpy(out, src, n * 4);
    } else {
      for (uint64_t i = 0; i < n; ++i) out[i] = ToFloat(src, i, type);
    }
    st = io->SubmitWrite(vfs::ChunkRef{p.info.id, p.f_main, c}, buf, reinterpret_cast<uint64_t>(buf));
  }
  while (io->in_flight() > 0) {
    done.clear();
    Status rs = io->Reap(&done, io->in_flight());
    for (auto& d : done) {
      if (!d.status.ok() && st.ok()) st = d.status;
    }
    if (!rs.ok()) {
      if (st.ok()) st = rs;
      break;
    }
  }
  impl->ReleaseStaging(bufs);
  if (!st.ok()) return st.WithContext("StreamedAdam: writing main of " + p.info.name);
  return Status::Ok();
}

Status StreamedAdam::RegisterParam(const std::string& name, uint64_t numel, uint32_t group, const void* d_initial,
                                   std::optional<DType> initial_type, const ShardInfo& shard) {
  OPTSTATE_RETURN_IF_ERROR(CheckUsable());
  if (in_step_) return FailedPrecondition("StreamedAdam::RegisterParam " + name + ": a step is in progress");
  OPTSTATE_RETURN_IF_ERROR(FinishCommit());
  auto it = params_.find(name);
  if (it != params_.end()) {
    OPTSTATE_RETURN_IF_ERROR(CheckSameGeometry(it->second.info, "it", numel, group, initial_type, shard));
    it->second.registered = true;
    any_registered_ = true;
    return Status::Ok();  // existing state is kept
  }
  if (retired_.count(name)) {
    return FailedPrecondition("StreamedAdam::RegisterParam '" + name + "': retired in this run (store " +
                              store_->path() + ")");
  }
  if (numel == 0) return InvalidArgument("StreamedAdam::RegisterParam " + name + ": numel is 0");
  if ((initial_type && !IsFloat(*initial_type)) || (d_initial != nullptr && !initial_type)) {
    return InvalidArgument("StreamedAdam::RegisterParam " + name + ": initial weights dtype " +
                           DTypeText(initial_type) + " not supported (f32, bf16, f16)");
  }
  // An entry in the index that is not a param: one no generation committed
  // (it holds no state), or one whose registration a failed step dropped.
  // Taken over when the geometry matches; its main is written again.
  std::optional<vfs::TensorInfo> entry;
  if (auto found = store_->FindTensor(name); found.ok()) {
    if (found->created_generation <= last_generation_ && !dropped_.count(name)) {
      return AlreadyExists("StreamedAdam::RegisterParam '" + name + "': store " + store_->path() +
                           " has a tensor of that name that is not an Adam param (no main/exp_avg/exp_avg_sq)");
    }
    OPTSTATE_RETURN_IF_ERROR(CheckSameGeometry(*found, "an uncommitted entry for it (a registration that was never "
                                               "committed)", numel, group, initial_type, shard));
    entry = *found;
  }
  if (uncommitted_steps_ > 0) {  // the new tensor is committed with state that is on disk
    auto d = MakeDurable();
    if (!d.ok()) return d.status().WithContext("StreamedAdam::RegisterParam " + name);
  }
  if (!groups_.count(group)) {
    OPTSTATE_LOG_INFO("StreamedAdam: param {} uses group {} that has no SetGroup; default hyperparameters", name,
                      group);
    groups_[group] = ParamGroup{.id = group};
    step_counts_.emplace(group, 0);
  }
  vfs::TensorInfo info;
  if (entry) {
    info = *entry;
  } else {
    vfs::TensorSpec spec;
    spec.name = name;
    spec.dtype = initial_type.value_or(DType::kF32);
    spec.numel = numel;
    spec.group = group;
    spec.shape = shard.shape;
    spec.global_shape = shard.global_shape;
    spec.shard_offset = shard.shard_offset;
    if (opts_.moment_dtype == MomentDType::kQ8) {
      spec.fields = vfs::AdamQ8Fields(numel, store_->chunk_size_bytes());
    } else {
      spec.fields = {{"main", DType::kF32},
                     {"exp_avg", MomentFieldDType(opts_.moment_dtype, "exp_avg")},
                     {"exp_avg_sq", MomentFieldDType(opts_.moment_dtype, "exp_avg_sq")}};
    }
    OPTSTATE_ASSIGN_OR_RETURN(info, store_->CreateTensor(spec));
  }
  Param p;
  p.info = info;
  OPTSTATE_ASSIGN_OR_RETURN(p.f_main, store_->FieldIndex(info, "main"));
  OPTSTATE_ASSIGN_OR_RETURN(p.f_m, store_->FieldIndex(info, "exp_avg"));
  OPTSTATE_ASSIGN_OR_RETURN(p.f_v, store_->FieldIndex(info, "exp_avg_sq"));
  if (opts_.moment_dtype == MomentDType::kQ8) {
    OPTSTATE_ASSIGN_OR_RETURN(p.f_ma, store_->FieldIndex(info, vfs::Q8ScalesField("exp_avg")));
    OPTSTATE_ASSIGN_OR_RETURN(p.f_va, store_->FieldIndex(info, vfs::Q8ScalesField("exp_avg_sq")));
  }
  p.committed = false;
  p.registered = true;
  tensor_counts_[info.id] = TensorCount{0, 0};  // a new param has taken no step
  any_registered_ = true;
  registrations_pending_ = true;
  dropped_.erase(name);
  auto [pit, inserted] = params_.emplace(name, std::move(p));
  (void)inserted;
  if (d_initial != nullptr) {
    Status ws = WriteMain(pit->second, d_initial, *initial_type);
    if (!ws.ok()) return AbortUncommitted(ws.WithContext("StreamedAdam::RegisterParam " + name));
  }
  return Status::Ok();
}

Status StreamedAdam::LoadMainFrom(const std::string& name, const void* d_weights, DType type) {
  OPTSTATE_RETURN_IF_ERROR(CheckUsable());
  if (in_step_) return FailedPrecondition("StreamedAdam::LoadMainFrom " + name + ": a step is in progress");
  OPTSTATE_RETURN_IF_ERROR(FinishCommit());
  auto it = params_.find(name);
  if (it == params_.end()) {
    return NotFound("StreamedAdam::LoadMainFrom: unknown param " + name + " (" + std::to_string(params_.size()) +
                    " registered in store " + store_->path() + ")");
  }
  if (d_weights == nullptr || !IsFloat(type)) {
    return InvalidArgument("StreamedAdam::LoadMainFrom " + name + ": need non-null weights of f32/bf16/f16, got " +
                           DTypeName(type));
  }
  if (uncommitted_steps_ > 0) {  // WriteMain replaces the cache's copy of this tensor
    auto d = MakeDurable();
    if (!d.ok()) return d.status().WithContext("StreamedAdam::LoadMainFrom " + name);
  }
  OPTSTATE_RETURN_IF_ERROR(ImplOf(*mm_)->DropTensor(it->second.info.id));
  it->second.main_pending = true;
  registrations_pending_ = true;
  Status ws = WriteMain(it->second, d_weights, type);
  if (!ws.ok()) return AbortUncommitted(ws.WithContext("StreamedAdam::LoadMainFrom " + name));
  return Status::Ok();
}

}  // namespace optstate::memmgr
