// An in-memory GenerationView for checkpoint format tests: deterministic
// bytes per (tensor, field), XXH3 checksums, no store underneath.
#pragma once

#include <xxhash.h>

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "vfs/store.h"

namespace optstate::vfs::testing {

class FakeView : public GenerationView {
 public:
  FakeView(uint64_t chunk_size, uint64_t generation, uint64_t step) {
    id_.uuid = "00000000-1111-2222-3333-444444444444";
    id_.name = "fake.store";
    id_.chunk_size_bytes = chunk_size;
    info_.generation = generation;
    info_.step = step;
    info_.groups = {{0, step, {{"lr", 1e-3}, {"beta1", 0.9}}}, {1, step - 1, {{"lr", 3.5e-4}}}};
  }
  // Adds a tensor whose bytes are a function of (seed, byte index).
  void Add(const std::string& name, uint64_t numel, uint32_t seed, std::vector<uint64_t> shape = {}) {
    TensorInfo t;
    t.name = name;
    t.numel = numel;
    t.shape = std::move(shape);
    t.id = next_id_++;
    t.fields = AdamFieldsLocal();
    for (uint32_t f = 0; f < t.fields.size(); ++f) {
      std::string bytes(numel * 4, '\0');
      uint64_t x = seed * 1000003ull + f * 7919ull + 1;
      for (size_t i = 0; i < bytes.size(); ++i) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        bytes[i] = static_cast<char>(x >> 56);
      }
      data_[{t.id, f}] = std::move(bytes);
    }
    tensors_.push_back(t);
    std::sort(tensors_.begin(), tensors_.end(),
              [](const TensorInfo& a, const TensorInfo& b) { return a.name < b.name; });
  }
  const std::string& Bytes(uint32_t tensor_id, uint32_t field) const {
    return data_.at({tensor_id, field});
  }
  // Flips one byte of the stored data (checksums stay: reads must fail).
  void Corrupt(uint32_t tensor_id, uint32_t field, uint64_t offset) {
    data_[{tensor_id, field}][offset] ^= 0x5a;
  }

  const StoreIdentity& identity() const override { return id_; }
  const GenerationInfo& info() const override { return info_; }
  const std::vector<TensorInfo>& tensors() const override { return tensors_; }
  Result<TensorInfo> FindTensor(std::string_view name) const override {
    for (const auto& t : tensors_) {
      if (t.name == name) return t;
    }
    return NotFound(std::string(name));
  }
  uint64_t ChunkCount(const TensorInfo& t, uint32_t) const override {
    uint64_t b = t.numel * 4, cs = id_.chunk_size_bytes;
    return (b + cs - 1) / cs;
  }
  Result<ChunkInfo> Chunk(const ChunkRef& ref) const override {
    const std::string& b = data_.at({ref.tensor_id, ref.field});
    ChunkInfo ci;
    ci.offset_bytes = ref.index * id_.chunk_size_bytes;
    ci.length_bytes = std::min<uint64_t>(id_.chunk_size_bytes, b.size() - ci.offset_bytes);
    ci.zero = false;
    ci.checksum = XXH3_64bits(pristine_.count({ref.tensor_id, ref.field})
                                  ? pristine_.at({ref.tensor_id, ref.field}).data() + ci.offset_bytes
                                  : b.data() + ci.offset_bytes,
                              ci.length_bytes);
    return ci;
  }
  using GenerationView::ReadChunk;
  Status ReadChunk(const ChunkRef& ref, void* buf, uint64_t /*buf_bytes*/) const override {
    auto ci = Chunk(ref);
    if (!ci.ok()) return ci.status();
    const std::string& b = data_.at({ref.tensor_id, ref.field});
    std::memcpy(buf, b.data() + ci->offset_bytes, ci->length_bytes);
    if (XXH3_64bits(buf, ci->length_bytes) != ci->checksum) {
      return Corruption("fake: checksum mismatch chunk " + std::to_string(ref.index));
    }
    ++reads_;
    return Status();
  }
  Result<std::unique_ptr<ChunkIo>> NewChunkIo(const ChunkIoOptions&) const override {
    return Unimplemented("fake view has no ChunkIo");
  }
  // Keep the original bytes for checksums, so later Corrupt() is detectable.
  void FreezeChecksums() { pristine_ = data_; }
  mutable uint64_t reads_ = 0;

 private:
  static std::vector<FieldSpec> AdamFieldsLocal() {
    return {{"main", DType::kF32}, {"exp_avg", DType::kF32}, {"exp_avg_sq", DType::kF32}};
  }
  StoreIdentity id_;
  GenerationInfo info_;
  std::vector<TensorInfo> tensors_;
  std::map<std::pair<uint32_t, uint32_t>, std::string> data_;
  std::map<std::pair<uint32_t, uint32_t>, std::string> pristine_;
  uint32_t next_id_ = 1;
};

}  // namespace optstate::vfs::testing
