// Resume on a different number of ranks equals no interruption: N ranks
// (one store and one StreamedAdam each, host backend) train K steps on their
// boxes of every tensor, export, reshard to M ranks, restore into M new
// stores and train J more steps; one uninterrupted run of the whole tensors
// for K + J steps on the same gradients must end with bit-identical mains and
// moments. Adam is elementwise, so any difference is a reshard that moved,
// dropped or altered a value (or lost the step counts or hyperparameters).
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "memmgr/memory_manager.h"
#include "memmgr/streamed_adam.h"
#include "tests/common/test_util.h"
#include "vfs/checkpoint.h"
#include "vfs/io_buffer.h"
#include "vfs/reshard.h"
#include "vfs/store.h"

namespace optstate {
namespace {

namespace fs = std::filesystem;
using memmgr::MemoryManager;
using memmgr::StreamedAdam;
using vfs::ShardBox;

constexpr uint64_t kChunk = 2 * vfs::kMiB;

struct Param {
  std::string name;
  std::vector<uint64_t> global_shape;
  uint32_t group;
};

// A 2-D tensor of ~2.4 MB per field (two chunks unsharded) and a 1-D one.
std::vector<Param> Model() { return {{"w", {300, 2000}, 0}, {"b", {1001}, 1}}; }

uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
// Values in [-1, 1) from (tensor, global index, step); step 0 = initial weights.
float Value(const std::string& tensor, uint64_t gi, uint64_t step) {
  const uint64_t h = Mix(std::hash<std::string>{}(tensor) ^ (step * 0x100000001B3ull) ^ (gi << 20));
  return static_cast<float>(static_cast<int64_t>(h >> 40) - (1 << 23)) / static_cast<float>(1 << 23);
}

// Global row-major index of each element of a box or flat range, in its order.
std::vector<uint64_t> GlobalIndices(const std::vector<uint64_t>& gshape, const ShardBox& b) {
  if (b.flat) {
    std::vector<uint64_t> out(b.shape[0]);
    for (uint64_t e = 0; e < out.size(); ++e) out[e] = b.offset[0] + e;
    return out;
  }
  uint64_t n = 1;
  for (uint64_t s : b.shape) n *= s;
  std::vector<uint64_t> out(n);
  std::vector<uint64_t> idx(b.shape.size(), 0);
  for (uint64_t e = 0; e < n; ++e) {
    uint64_t gi = 0;
    for (size_t d = 0; d < b.shape.size(); ++d) gi = gi * gshape[d] + b.offset[d] + idx[d];
    out[e] = gi;
    for (size_t d = b.shape.size(); d-- > 0;) {
      if (++idx[d] < b.shape[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

// One rank: its store, memory manager and optimizer, and the boxes it owns.
class Rank {
 public:
  // A new store (restore_from empty) or one created from a checkpoint.
  Rank(const std::string& store_path, const std::map<std::string, ShardBox>& boxes,
       const std::string& restore_from = "") : boxes_(boxes) {
    vfs::StoreOptions so;
    so.chunk_size_bytes = kChunk;
    so.preallocate_step_bytes = 16 * vfs::kMiB;
    so.job = "resume-test";  // the ranks of one job (a store restored from a checkpoint inherits its job)
    auto s = restore_from.empty() ? vfs::Store::Create(store_path, so)
                                  : vfs::CreateStoreFromCheckpoint(restore_from, store_path, so);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    store_ = std::move(*s);
    memmgr::MemoryManagerOptions mo;
    mo.backend = memmgr::Backend::kHost;
    mo.device_budget_bytes = 64 * vfs::kMiB;
    mo.host_cache_bytes = 0;
    auto mm = MemoryManager::Create(store_.get(), mo);
    EXPECT_TRUE(mm.ok()) << mm.status().ToString();
    mm_ = std::move(*mm);
    auto opt = StreamedAdam::Create(store_.get(), mm_.get(), memmgr::StreamedAdamOptions{});
    EXPECT_TRUE(opt.ok()) << opt.status().ToString();
    opt_ = std::move(*opt);
    if (restore_from.empty()) {
      EXPECT_TRUE(opt_->SetGroup({0, 1e-2, 0.9, 0.999, 1e-8, 0.01, true}).ok());
      EXPECT_TRUE(opt_->SetGroup({1, 3e-3, 0.8, 0.99, 1e-6, 0.0, false}).ok());
    }
    for (const Param& p : Model()) {
      auto it = boxes_.find(p.name);
      if (it == boxes_.end()) continue;
      const std::vector<uint64_t> gi = GlobalIndices(p.global_shape, it->second);
      std::vector<float> init(gi.size());
      for (size_t i = 0; i < gi.size(); ++i) init[i] = Value(p.name, gi[i], 0);
      memmgr::ShardInfo shard{it->second.shape, p.global_shape, it->second.offset};
      // Restored: the same geometry registers nothing new and keeps the state.
      Status st = opt_->RegisterParam(p.name, gi.size(), p.group, init.data(), DType::kF32, shard);
      EXPECT_TRUE(st.ok()) << st.ToString();
      indices_[p.name] = gi;
    }
  }
  ~Rank() {
    opt_.reset();
    mm_.reset();
    store_.reset();
  }

  // Global step `step`: each param's gradient at its elements' global indices.
  void Step(uint64_t step) {
    std::vector<std::vector<float>> grads;
    std::vector<memmgr::ParamGrad> pg;
    for (const auto& [name, gi] : indices_) {
      grads.emplace_back(gi.size());
      for (size_t i = 0; i < gi.size(); ++i) grads.back()[i] = Value(name, gi[i], step);
    }
    size_t k = 0;
    for (const auto& [name, gi] : indices_) {
      memmgr::ParamGrad g;
      g.name = name;
      g.d_grad = grads[k++].data();
      g.numel = gi.size();
      pg.push_back(g);
    }
    Status st = opt_->Step(pg);
    ASSERT_TRUE(st.ok()) << st.ToString();
  }

  // Commits everything (the last step's commit runs in the background).
  void Durable() {
    ASSERT_TRUE(opt_->WaitForCommit().ok());
    ASSERT_TRUE(opt_->MakeDurable().ok());
  }

  // tensor/field -> global index -> value, of this rank's boxes.
  void Collect(std::map<std::string, std::map<uint64_t, uint32_t>>* out) {
    auto v = store_->OpenGeneration(vfs::kLatest);
    ASSERT_TRUE(v.ok()) << v.status().ToString();
    vfs::IoBuffer buf(kChunk);  // chunk reads may be O_DIRECT: page-aligned
    for (const vfs::TensorInfo& t : (*v)->tensors()) {
      const std::vector<uint64_t>& gi = indices_.at(t.name);
      for (uint32_t f = 0; f < t.fields.size(); ++f) {
        ASSERT_EQ(t.fields[f].dtype, DType::kF32);
        std::vector<uint32_t> bits(t.numel);
        for (uint64_t c = 0; c < (*v)->ChunkCount(t, f); ++c) {
          Status st = (*v)->ReadChunk({t.id, f, c}, buf.data());
          ASSERT_TRUE(st.ok()) << st.ToString();
          const uint64_t n = std::min<uint64_t>(kChunk / 4, t.numel - c * (kChunk / 4));
          std::memcpy(bits.data() + c * (kChunk / 4), buf.as<char>(), n * 4);
        }
        auto& m = (*out)[t.name + "/" + t.fields[f].name];
        for (size_t i = 0; i < gi.size(); ++i) m[gi[i]] = bits[i];
      }
    }
  }

  vfs::Store* store() { return store_.get(); }

 private:
  std::map<std::string, ShardBox> boxes_;
  std::map<std::string, std::vector<uint64_t>> indices_;
  std::unique_ptr<vfs::Store> store_;
  std::unique_ptr<MemoryManager> mm_;
  std::unique_ptr<StreamedAdam> opt_;
};

std::vector<vfs::GlobalTensor> Globals() {
  std::vector<vfs::GlobalTensor> out;
  for (const Param& p : Model()) out.push_back({p.name, p.global_shape});
  return out;
}

void ResumeEqualsNoInterruption(const vfs::TargetLayout& before, const vfs::TargetLayout& after) {
  const size_t n = before.ranks.size(), m = after.ranks.size();
  constexpr uint64_t kK = 3, kJ = 2;
  test_util::TempDir dir("/var/tmp/optstate-resume-");
  // The uninterrupted run: one rank holding every tensor whole.
  std::map<std::string, std::map<uint64_t, uint32_t>> want, got;
  {
    Rank whole(dir / "whole", vfs::MakeEvenLayout(Globals(), 1, vfs::SplitKind::kRows).ranks[0]);
    for (uint64_t s = 1; s <= kK + kJ; ++s) whole.Step(s);
    whole.Durable();
    whole.Collect(&want);
  }
  // N ranks for K steps, exported.
  std::vector<std::string> ckpts;
  for (uint32_t r = 0; r < n; ++r) {
    Rank rank(dir / ("a" + std::to_string(r)), before.ranks[r]);
    for (uint64_t s = 1; s <= kK; ++s) rank.Step(s);
    rank.Durable();
    ckpts.push_back(dir / ("ckpt" + std::to_string(r)));
    auto e = vfs::ExportCheckpoint(rank.store(), ckpts.back());
    ASSERT_TRUE(e.ok()) << e.status().ToString();
  }
  // Resharded to M, restored into M new stores, J more steps.
  auto rs = vfs::Reshard(ckpts, after, dir / "resharded");
  ASSERT_TRUE(rs.ok()) << rs.status().ToString();
  for (uint32_t r = 0; r < m; ++r) {
    Rank rank(dir / ("b" + std::to_string(r)), after.ranks[r],
              dir / ("resharded/" + vfs::ReshardRankDirName(r)));
    EXPECT_EQ(rank.store()->LatestGeneration().step, kK);
    for (uint64_t s = kK + 1; s <= kK + kJ; ++s) rank.Step(s);
    rank.Durable();
    rank.Collect(&got);
  }
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [key, values] : want) {
    ASSERT_EQ(got[key].size(), values.size()) << key;
    uint64_t differ = 0;
    for (const auto& [gi, bits] : values) differ += got[key][gi] != bits;
    EXPECT_EQ(differ, 0u) << key << ": elements not bit-identical with the uninterrupted run";
  }
  // The moments moved: a run that lost them would still match at step 0.
  EXPECT_NE(want["w/exp_avg"][0], 0u);
}

TEST(ReshardResume, FourRowRanksToThreeColumnRanks) {
  ResumeEqualsNoInterruption(vfs::MakeEvenLayout(Globals(), 4, vfs::SplitKind::kRows),
                             vfs::MakeEvenLayout(Globals(), 3, vfs::SplitKind::kColumns));
}

TEST(ReshardResume, TwoColumnRanksToFiveRowRanks) {
  ResumeEqualsNoInterruption(vfs::MakeEvenLayout(Globals(), 2, vfs::SplitKind::kColumns),
                             vfs::MakeEvenLayout(Globals(), 5, vfs::SplitKind::kRows));
}

// Tensor-parallel row boxes to a data-parallel optimizer's flat buckets of the
// same 2-D weight: the resumed ranks register flat ranges of it (1-D shape and
// offset, the real global shape).
TEST(ReshardResume, FourRowRanksToThreeFlatBucketRanks) {
  // One bucket of w and b (601001 elements): ranges of 200334 cut w's rows mid-row.
  auto buckets = vfs::MakeBucketLayout(Globals(), 1 << 20, 3);
  ASSERT_TRUE(buckets.ok()) << buckets.status().ToString();
  ASSERT_TRUE(buckets->ranks[1].at("w").flat);
  ASSERT_NE(buckets->ranks[1].at("w").offset[0] % 2000, 0u);
  ResumeEqualsNoInterruption(vfs::MakeEvenLayout(Globals(), 4, vfs::SplitKind::kRows), *buckets);
}

}  // namespace
}  // namespace optstate
