// StreamedAdam: the params of a run: registration (new or restored), their
// initial weights, LoadMainFrom, retirement, and dropping registrations that
// no generation committed.
#include "memmgr/internal/streamed_engine.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "memmgr/internal/engine_memory.h"
#include "memmgr/internal/slice_pipeline.h"
#include "memmgr/internal/streamed_adam_util.h"
#include "base/log.h"

namespace optstate::memmgr::internal {


std::vector<std::string> StreamedEngine::UnregisteredParams() const { return params_.Unregistered(); }

Status StreamedEngine::RetireParam(const std::string& name) {
  OPTSTATE_RETURN_IF_ERROR(CheckUsable());
  if (step_.in_step()) return FailedPrecondition("StreamedAdam::RetireParam '" + name + "': a step is in progress");
  OPTSTATE_RETURN_IF_ERROR(FinishCommit());
  const Param* p = params_.Find(name);
  if (p == nullptr) {
    return NotFound("StreamedAdam::RetireParam: store " + store_->path() + " has no param '" + name + "'" +
                    (params_.retired(name) ? " (already retired in this run)" : ""));
  }
  if (p->registered || !p->committed) {
    return FailedPrecondition("StreamedAdam::RetireParam '" + name + "': registered in this run (store " +
                              store_->path() + "); only a param restored from the store and not registered can be "
                              "retired");
  }
  params_.Retire(name);
  OPTSTATE_LOG_INFO("StreamedAdam: param {} of store {} retired for this run; its state stays in the store unchanged",
                    name, store_->path());
  return Status::Ok();
}

Status StreamedEngine::CheckModelComplete() const {
  std::vector<std::string> missing = params_.Unregistered();
  if (missing.empty()) return Status::Ok();
  return FailedPrecondition(
      "StreamedAdam: store " + store_->path() + " holds " + std::to_string(missing.size()) +
      " param(s) that this run did not register: " +
      NameList(missing.begin(), missing.end(), [&](const std::string& n) { return params_.Find(n)->info.numel; }) +
      "; register them (their stored state is kept) or RetireParam them (their state stays in the store, "
      "unchanged); nothing was stepped or committed");
}

Status StreamedEngine::CheckSameGeometry(const vfs::TensorInfo& t, const std::string& what, uint64_t numel,
                                       uint32_t group, std::optional<DType> initial_type,
                                       const ShardInfo& shard, uint32_t rule) const {
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
  return rules_[rule]->CheckStored(store_->path(), t);
}

std::string StreamedEngine::DropUncommittedRegistrations() {
  ParamRegistry::Dropped d = params_.DropUncommitted([this](const Param& p) {
    mem_->cache()->EraseTensor(p.info.id);
    (void)mem_->DropTensor(p.info.id);
    if (!p.committed) counts_.EraseTensor(p.info.id);
  });
  const std::vector<std::string>& dropped = d.erased;
  const std::vector<std::string>& reloaded = d.reloaded;
  const std::map<std::string, uint64_t>& numels = d.numels;
  std::string msg;
  if (!dropped.empty()) {
    msg = "the registration of " + std::to_string(dropped.size()) + " new param(s) not yet committed was dropped (" +
          NameList(dropped.begin(), dropped.end(), [&](const std::string& n) { return numels.at(n); }) +
          "): register them again";
  }
  if (!reloaded.empty()) {
    msg += (msg.empty() ? "" : "; ") + std::string("the weights LoadMainFrom loaded into ") +
           NameList(reloaded.begin(), reloaded.end(), [](const std::string&) { return uint64_t{0}; }) +
           " were dropped (main is back at generation " + std::to_string(counts_.last_generation()) +
           "): load them again";
  }
  return msg;
}

Status StreamedEngine::AbortUncommitted(Status s) {
  Status a = store_->AbortPending();
  if (!a.ok()) OPTSTATE_LOG_ERROR("StreamedAdam: AbortPending after a failed write: {}", a.ToString());
  mem_->OnAbortPending();
  return WithNote(s, DropUncommittedRegistrations());
}

Status StreamedEngine::WriteMain(const Param& p, const void* d_src, DType type) {
  return WriteMains({MainSource{&p, d_src, type}});
}

Status StreamedEngine::WriteMains(const std::vector<MainSource>& srcs) {
  if (srcs.empty()) return Status::Ok();
  internal::EngineMemory* impl = mem_;
  Device* dev = impl->device();
  const uint64_t chunk = impl->page_bytes();
  const uint64_t chunk_elems = chunk / 4;
  for (const MainSource& m : srcs) impl->cache()->EraseTensor(m.p->info.id);
  Status ios = EnsureIo();
  if (!ios.ok()) return ios.WithContext("StreamedAdam: writing main of " + srcs.front().p->info.name);
  std::vector<void*> bufs = impl->AcquireStaging(1, 8);
  std::vector<char> bounce;
  vfs::ChunkIo* io = io_.get();
  std::vector<vfs::ChunkCompletion> done;
  Status st;
  std::string failed;  // the param of the first failed write
  std::vector<const Param*> by_tag;  // the param each request in flight writes (tag: its buffer)
  std::unordered_map<uint64_t, const Param*> writing;
  // Reaps at least min_done writes; each gives its buffer back to `free_bufs`.
  auto reap = [&](std::vector<void*>* free_bufs, size_t min_done) {
    done.clear();
    Status rs = io->Reap(&done, min_done);
    for (auto& d : done) {
      if (!d.status.ok() && st.ok()) {
        st = d.status;
        auto w = writing.find(d.tag);
        failed = w == writing.end() ? "?" : w->second->info.name;
      }
      writing.erase(d.tag);
      free_bufs->push_back(reinterpret_cast<void*>(d.tag));
    }
    if (!rs.ok() && st.ok()) st = rs;
    return rs.ok();
  };
  // Converts chunk c of m into buf and submits its write.
  auto write_chunk = [&](const MainSource& m, uint64_t c, void* buf) {
    const uint64_t numel = m.p->info.numel;
    const uint32_t src_size = DTypeSize(m.type);
    const uint64_t first = c * chunk_elems, n = std::min(chunk_elems, numel - first);
    const char* src = static_cast<const char*>(m.src) + first * src_size;
    if (dev->backend() == Backend::kCuda) {
      bounce.resize(n * src_size);
      st = dev->CopyD2H(bounce.data(), src, n * src_size, nullptr);
      if (st.ok()) st = dev->SyncStream(nullptr);
      if (!st.ok()) {
        failed = m.p->info.name;
        return;
      }
      src = bounce.data();
    }
    float* out = static_cast<float*>(buf);
    if (m.type == DType::kF32) {
      std::memcpy(out, src, n * 4);
    } else {
      for (uint64_t i = 0; i < n; ++i) out[i] = kernels::ElementAsFloat(m.type, src, i);
    }
    const uint64_t tag = reinterpret_cast<uint64_t>(buf);
    st = io->SubmitWrite(vfs::ChunkRef{m.p->info.id, m.p->fields[0], c}, buf, tag);
    if (st.ok()) {
      writing[tag] = m.p;
    } else {
      failed = m.p->info.name;
    }
  };
  // Two passes, so that many small mains are in flight at once: chunks of at
  // most kSmallSliceBytes go out from pieces of the staging buffers (as a
  // step's small slices do), then bigger ones from whole buffers.
  const uint64_t piece = internal::kSmallSliceBytes;
  for (int pass = 0; pass < 2 && st.ok(); ++pass) {
    std::vector<void*> free_bufs;
    for (void* b : bufs) {
      if (pass == 0 && chunk >= 2 * piece) {
        for (uint64_t k = 0; k < chunk / piece; ++k) free_bufs.push_back(static_cast<char*>(b) + k * piece);
      } else {
        free_bufs.push_back(b);
      }
    }
    for (const MainSource& m : srcs) {
      const uint64_t numel = m.p->info.numel;
      const uint64_t nchunks = (numel + chunk_elems - 1) / chunk_elems;
      for (uint64_t c = 0; c < nchunks && st.ok(); ++c) {
        const bool small = std::min(chunk_elems, numel - c * chunk_elems) * 4 <= piece && chunk >= 2 * piece;
        if (small != (pass == 0)) continue;
        while (free_bufs.empty() && st.ok()) {
          if (!reap(&free_bufs, 1)) break;
        }
        if (!st.ok()) break;
        void* buf = free_bufs.back();
        free_bufs.pop_back();
        write_chunk(m, c, buf);
      }
      if (!st.ok()) break;
    }
    while (io->in_flight() > 0) {
      if (!reap(&free_bufs, io->in_flight())) break;
    }
  }
  impl->ReleaseStaging(bufs);
  if (!st.ok()) return st.WithContext("StreamedAdam: writing main of " + failed);
  return Status::Ok();
}

Status StreamedEngine::RegisterParam(const std::string& name, uint64_t numel, uint32_t group, const void* d_initial,
                                   std::optional<DType> initial_type, const ShardInfo& shard, uint32_t rule) {
  ParamSpec spec{name, numel, group, d_initial, initial_type, shard, rule};
  return RegisterParams(std::span<const ParamSpec>(&spec, 1), nullptr);
}

Status StreamedEngine::CheckRegistration(const ParamSpec& r, bool* existing,
                                       std::optional<vfs::TensorInfo>* entry) const {
  const std::string& name = r.name;
  *existing = false;
  if (r.rule >= rules_.size()) {
    return InvalidArgument("StreamedAdam::RegisterParam '" + name + "': update rule " + std::to_string(r.rule) +
                           " of " + std::to_string(rules_.size()) + " (" + RuleNames() + "; store " +
                           store_->path() + ")");
  }
  if (const Param* p = params_.Find(name)) {
    if (p->rule != r.rule) {
      return InvalidArgument("StreamedAdam::RegisterParam '" + name + "': store " + store_->path() +
                             " holds the tensor as a param of update rule " + std::string(rules_[p->rule]->name()) +
                             ", registered with update rule " + std::string(rules_[r.rule]->name()) +
                             " (nothing changed)");
    }
    OPTSTATE_RETURN_IF_ERROR(CheckSameGeometry(p->info, "it", r.numel, r.group, r.initial_type, r.shard, r.rule));
    *existing = true;
    return Status::Ok();
  }
  if (params_.retired(name)) {
    return FailedPrecondition("StreamedAdam::RegisterParam '" + name + "': retired in this run (store " +
                              store_->path() + ")");
  }
  if (r.numel == 0) return InvalidArgument("StreamedAdam::RegisterParam " + name + ": numel is 0");
  OPTSTATE_RETURN_IF_ERROR(rules_[r.rule]->CheckShape(
      store_->path(), name, r.shard.shape.empty() ? std::vector<uint64_t>{r.numel} : r.shard.shape, r.numel));
  OPTSTATE_RETURN_IF_ERROR(CheckUnitFits(name, r.rule, r.numel, r.shard.shape));
  if ((r.initial_type && !IsFloat(*r.initial_type)) || (r.d_initial != nullptr && !r.initial_type)) {
    return InvalidArgument("StreamedAdam::RegisterParam " + name + ": initial weights dtype " +
                           DTypeText(r.initial_type) + " not supported (f32, bf16, f16)");
  }
  // An entry in the index that is not a param: one no generation committed
  // (it holds no state), or one whose registration a failed step dropped.
  // Taken over when the geometry matches; its main is written again.
  if (auto found = store_->LookupTensor(name)) {
    if (found->created_generation <= counts_.last_generation() && !params_.dropped(name)) {
      // Name the fields of the rule the tensor lacks (another rule's tensor:
      // Lion's exp_avg where SGD keeps a momentum_buffer, ...).
      std::string keeps, lacks;
      const UpdateRule& rule = *rules_[r.rule];
      for (const RuleField& f : rule.Fields()) {
        keeps += (keeps.empty() ? "" : ", ") + f.name;
        if (found->FieldIndexOf(f.name) < 0) lacks += (lacks.empty() ? "" : ", ") + f.name;
      }
      return AlreadyExists("StreamedAdam::RegisterParam '" + name + "': store " + store_->path() +
                           " has a tensor of that name that is not a param of this optimizer's rule (" +
                           std::string(rule.name()) + " keeps " + keeps + "; the tensor lacks " +
                           (lacks.empty() ? std::string("none of them") : lacks) + ")");
    }
    OPTSTATE_RETURN_IF_ERROR(CheckSameGeometry(*found, "an uncommitted entry for it (a registration that was never "
                                               "committed)", r.numel, r.group, r.initial_type, r.shard, r.rule));
    *entry = std::move(*found);
  }
  return Status::Ok();
}

Status StreamedEngine::RegisterParams(std::span<const ParamSpec> specs, std::vector<bool>* existed) {
  OPTSTATE_RETURN_IF_ERROR(CheckUsable());
  if (existed != nullptr) existed->assign(specs.size(), false);
  if (specs.empty()) return Status::Ok();
  if (step_.in_step()) {
    return FailedPrecondition("StreamedAdam::RegisterParam " + specs[0].name + ": a step is in progress");
  }
  OPTSTATE_RETURN_IF_ERROR(FinishCommit());
  // Every registration is checked before any changes anything.
  std::vector<std::optional<vfs::TensorInfo>> entries(specs.size());
  std::vector<bool> existing(specs.size(), false);
  std::set<std::string_view> names;
  bool any_new = false;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (!names.insert(specs[i].name).second) {
      return InvalidArgument("StreamedAdam::RegisterParam '" + specs[i].name + "': given twice in one "
                             "registration (store " + store_->path() + ")");
    }
    bool e = false;
    OPTSTATE_RETURN_IF_ERROR(CheckRegistration(specs[i], &e, &entries[i]));
    existing[i] = e;
    any_new = any_new || !e;
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    if (!existing[i]) continue;
    params_.MarkRegistered(params_.Find(specs[i].name));
    if (existed != nullptr) (*existed)[i] = true;
  }
  if (!any_new) return Status::Ok();  // existing state is kept
  if (counts_.uncommitted_steps() > 0) {  // the new tensors are committed with state that is on disk
    auto d = MakeDurable();
    if (!d.ok()) return d.status().WithContext("StreamedAdam::RegisterParam " + specs[0].name);
  }
  std::vector<MainSource> mains;
  bool created_any = false;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (existing[i]) continue;
    const ParamSpec& r = specs[i];
    const std::string& name = r.name;
    if (!groups_.count(r.group)) {
      OPTSTATE_LOG_INFO("StreamedAdam: param {} uses group {} that has no SetGroup; default hyperparameters", name,
                        r.group);
      PutGroup(r.group, {});
      counts_.AddGroup(r.group);
    }
    vfs::TensorInfo info;
    if (entries[i]) {
      info = std::move(*entries[i]);
    } else {
      vfs::TensorSpec spec;
      spec.name = name;
      spec.dtype = r.initial_type.value_or(DType::kF32);
      spec.numel = r.numel;
      spec.group = r.group;
      spec.shape = r.shard.shape;
      spec.global_shape = r.shard.global_shape;
      spec.shard_offset = r.shard.shard_offset;
      spec.fields = layouts_[r.rule]->FieldSpecs(*rules_[r.rule], r.numel);
      auto created = store_->CreateTensor(spec);
      if (!created.ok()) {
        // This call's registrations before it (their mains not yet written)
        // are dropped with the pending generation's other uncommitted ones.
        if (created_any) return AbortUncommitted(created.status());
        return created.status();
      }
      created_any = true;
      info = std::move(*created);
    }
    Param p;
    p.info = std::move(info);
    p.rule = r.rule;
    OPTSTATE_RETURN_IF_ERROR(ResolveFields(&p));
    counts_.AddTensor(p.info.id);  // a new param has taken no step
    Param& added = params_.AddNew(name, std::move(p));
    if (r.d_initial != nullptr) mains.push_back(MainSource{&added, r.d_initial, *r.initial_type});
  }
  Status ws = WriteMains(mains);
  if (!ws.ok()) {
    return AbortUncommitted(
        ws.WithContext("StreamedAdam::RegisterParam" + (specs.size() == 1 ? " " + specs[0].name : std::string("s"))));
  }
  return Status::Ok();
}

Status StreamedEngine::LoadMainFrom(const std::string& name, const void* d_weights, DType type) {
  OPTSTATE_RETURN_IF_ERROR(CheckUsable());
  if (step_.in_step()) return FailedPrecondition("StreamedAdam::LoadMainFrom " + name + ": a step is in progress");
  OPTSTATE_RETURN_IF_ERROR(FinishCommit());
  Param* p = params_.Find(name);
  if (p == nullptr) {
    return NotFound("StreamedAdam::LoadMainFrom: unknown param " + name + " (" + std::to_string(params_.size()) +
                    " registered in store " + store_->path() + ")");
  }
  if (d_weights == nullptr || !IsFloat(type)) {
    return InvalidArgument("StreamedAdam::LoadMainFrom " + name + ": need non-null weights of f32/bf16/f16, got " +
                           DTypeName(type));
  }
  if (counts_.uncommitted_steps() > 0) {  // WriteMain replaces the cache's copy of this tensor
    auto d = MakeDurable();
    if (!d.ok()) return d.status().WithContext("StreamedAdam::LoadMainFrom " + name);
  }
  OPTSTATE_RETURN_IF_ERROR(mem_->DropTensor(p->info.id));
  params_.MarkMainPending(p);
  Status ws = WriteMain(*p, d_weights, type);
  if (!ws.ok()) return AbortUncommitted(ws.WithContext("StreamedAdam::LoadMainFrom " + name));
  return Status::Ok();
}

}  // namespace optstate::memmgr::internal
