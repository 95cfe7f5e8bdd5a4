// GenerationView of a store (vfs/internal/generation_view.h): a frozen
// generation's tensors and chunk versions, read synchronously or through a ChunkIo.
#include "vfs/internal/generation_view.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "vfs/internal/chunk_io.h"

namespace optstate::vfs::internal {

// Builds the frozen view of generation g.
std::shared_ptr<ViewData> BuildView(const std::shared_ptr<Core>& core, uint64_t g) {
  auto v = std::make_shared<ViewData>();
  v->core = core;
  v->info = core->generations_.at(g);
  for (const auto* m : {&core->tensors_, &core->dropped_}) {
    for (const auto& [id, t] : *m) {
      if (core->TensorAt(id, g)) {
        v->tensors.push_back(t);
        v->by_id[id] = t;
      }
    }
  }
  std::sort(v->tensors.begin(), v->tensors.end(),
            [](const TensorInfo& a, const TensorInfo& b) { return a.name < b.name; });
  for (const auto& [key, vs] : core->versions_) {
    if (!v->by_id.count(key.t)) continue;
    for (const auto& ver : vs) {
      if (ver.gen <= g) {
        v->chunks.emplace(key, ver);
        break;
      }
    }
  }
  return v;
}

namespace {

class GenerationViewImpl final : public GenerationView {
 public:
  explicit GenerationViewImpl(std::shared_ptr<ViewData> v) : v_(std::move(v)) {}
  const StoreIdentity& identity() const override { return v_->core->identity(); }
  const GenerationInfo& info() const override { return v_->info; }
  const std::vector<TensorInfo>& tensors() const override { return v_->tensors; }
  Result<TensorInfo> FindTensor(std::string_view name) const override {
    for (const auto& t : v_->tensors) {
      if (t.name == name) return t;
    }
    std::vector<std::string> names;
    for (const auto& t : v_->tensors) names.push_back(t.name);
    return NotFound("store " + v_->core->path() + " generation " + std::to_string(v_->info.generation) +
                    ": no tensor '" + std::string(name) + "'" + ClosestNames(name, names.begin(), names.end()));
  }
  uint64_t ChunkCount(const TensorInfo& t, uint32_t field) const override {
    return Core::ChunkCountOf(t, field, v_->core->chunk());
  }
  Result<ChunkInfo> Chunk(const ChunkRef& ref) const override {
    const Core* c = v_->core.get();
    uint64_t len, stride;
    {
      MutexLock l(&c->mu());
      OPTSTATE_ASSIGN_OR_RETURN(auto res, c->Resolve(v_->by_id, ref));
      len = res.second;
      stride = res.first->field_chunk_bytes(ref.field, c->chunk());
    }
    ChunkInfo info;
    info.offset_bytes = ref.index * stride;
    info.length_bytes = len;
    auto it = v_->chunks.find(Key{ref.tensor_id, ref.field, ref.index});
    if (it == v_->chunks.end()) {
      info.zero = true;
      info.checksum = ZeroChecksum(len);
      return info;
    }
    info.zero = false;
    info.checksum = it->second.ext.checksum;
    info.written_generation = it->second.gen;
    info.data_dir = it->second.ext.dir;
    info.file_offset = it->second.ext.file_offset;
    return info;
  }
  Status ReadChunk(const ChunkRef& ref, void* buf, uint64_t buf_bytes) const override {
    Core* c = v_->core.get();
    const Key k{ref.tensor_id, ref.field, ref.index};
    const TensorInfo* t;
    uint64_t n = 0;
    {
      MutexLock l(&c->mu());
      OPTSTATE_ASSIGN_OR_RETURN(auto res, c->Resolve(v_->by_id, ref));
      t = res.first;
      OPTSTATE_ASSIGN_OR_RETURN(n, BufferBytesFor(*c, t, k, res.second, buf_bytes));
    }
    auto it = v_->chunks.find(k);
    if (it == v_->chunks.end()) {
      std::memset(buf, 0, n);
      return Status();
    }
    return ReadVersion(c, t, k, it->second, buf, n);
  }
  Result<std::unique_ptr<ChunkIo>> NewChunkIo(const ChunkIoOptions& opts) const override {
    return MakeChunkIo(v_->core, v_, opts);
  }
  const ViewData& data() const { return *v_; }

 private:
  uint64_t ZeroChecksum(uint64_t len) const {
    static thread_local std::vector<char> zeros;
    if (zeros.size() < len) zeros.assign(len, 0);
    return ChunkChecksum(zeros.data(), len);
  }
  std::shared_ptr<ViewData> v_;
};

}  // namespace

std::unique_ptr<GenerationView> NewGenerationView(std::shared_ptr<ViewData> v) {
  return std::make_unique<GenerationViewImpl>(std::move(v));
}

const ViewData& ViewDataOf(const GenerationView& view) { return static_cast<const GenerationViewImpl&>(view).data(); }

}  // namespace optstate::vfs::internal
