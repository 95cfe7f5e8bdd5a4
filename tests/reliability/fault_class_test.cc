// Fail the Nth operation of ONE class, for every class and every N of a short
// workload, once and persistently (EIO; ENOSPC too for write/fallocate), and
// short reads/writes of every N. Extends tests/vfs/store_fault_test.cc (which
// fails the Nth operation of any class, once, and every 3rd persistently):
// here a persistent fault stays confined to one class while the others keep
// working (e.g. every RocksDB sync fails while data writes succeed), which is
// the realistic shape of a failing device path, and the error text is checked.
//
// Each run: the failing call returns a non-OK status whose message keeps the
// injected cause (op class + path); in the same process the latest committed
// generation is the acknowledged one, exact; after reopen without faults the
// store is at the acknowledged generation (or the next, when the failure hit
// after the commit batch reached RocksDB), exact against the independent
// reference, Verify clean, no leaked extent after GC. Short transfers must be
// invisible (the engines resubmit the rest).
#include <filesystem>

#include <gtest/gtest.h>

#include "tests/reliability/reliability_util.h"
#include "vfs/fault_injection.h"

namespace optstate::reliability {
namespace {

using vfs::FaultInjectionFileSystem;
using vfs::FaultRule;
using vfs::FileSystem;
using vfs::OpClass;
using vfs::Store;
using vfs::StoreOptions;
using wl::TempDir;
using wl::WorkloadOptions;

class FaultClassTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = dir_ / "store";
    golden_ = dir_ / "golden";
    auto s = Store::Create(path_, WorkloadOptions());
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    auto c = CommitWorkloadGeneration(s->get(), 1);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    s->reset();
    std::filesystem::copy(path_, golden_, std::filesystem::copy_options::recursive);
  }
  void Reset() {
    std::filesystem::remove_all(path_);
    std::filesystem::copy(golden_, path_, std::filesystem::copy_options::recursive);
  }

  // Generations 2..3 (3 through the asynchronous ChunkIo), a read back through
  // a view, a snapshot and its release, GC. Returns the first error.
  Status Workload(FaultInjectionFileSystem* fs, uint64_t* acked, std::unique_ptr<Store>* out) {
    StoreOptions opts = WorkloadOptions();
    opts.fs = fs;
    OPTSTATE_ASSIGN_OR_RETURN(*out, Store::Open(path_, opts));
    Store* s = out->get();
    std::vector<vfs::TensorInfo> tensors;
    OPTSTATE_RETURN_IF_ERROR(EnsureWorkloadTensors(s, &tensors));
    for (uint64_t g = 2; g <= 3; ++g) {
      if (g == 3) {
        OPTSTATE_ASSIGN_OR_RETURN(auto io, s->NewChunkIo(vfs::ChunkIoOptions{}));
        std::vector<std::unique_ptr<Buf>> bufs;
        for (uint32_t ti = 0; ti < tensors.size(); ++ti) {
          for (uint32_t f = 0; f < 3; ++f) {
            for (uint64_t c = 0; c < s->ChunkCount(tensors[ti], f); ++c) {
              if (!wl::Writes(g, ti, f, c)) continue;
              bufs.push_back(std::make_unique<Buf>(kTestChunk));
              wl::FillPattern(bufs.back()->data(), kTestChunk, wl::WorkloadSeed(g, ti, f, c));
              Status st = io->SubmitWrite(vfs::ChunkRef{tensors[ti].id, f, c}, bufs.back()->data(), bufs.size());
              if (!st.ok()) {
                std::vector<vfs::ChunkCompletion> drain;
                while (io->in_flight() > 0 && io->Reap(&drain, 1).ok()) {
                }
                return st;
              }
            }
          }
        }
        std::vector<vfs::ChunkCompletion> done;
        while (io->in_flight() > 0) OPTSTATE_RETURN_IF_ERROR(io->Reap(&done, 1));
        for (const auto& d : done) OPTSTATE_RETURN_IF_ERROR(d.status);
      } else {
        OPTSTATE_RETURN_IF_ERROR(WriteWorkloadGeneration(s, tensors, g));
      }
      OPTSTATE_ASSIGN_OR_RETURN(uint64_t committed, s->Commit(WorkloadCommitInfo(g)));
      if (committed != g) return Internal("committed " + std::to_string(committed));
      *acked = g;
      {
        OPTSTATE_ASSIGN_OR_RETURN(auto view, s->OpenGeneration(vfs::kLatest));
        Buf b(kTestChunk);
        OPTSTATE_RETURN_IF_ERROR(view->ReadChunk(vfs::ChunkRef{tensors[0].id, static_cast<uint32_t>(g % 3), 0}, b.data()));
      }
      if (g == 2) OPTSTATE_RETURN_IF_ERROR(s->CreateSnapshot("two").status());
      if (g == 3) OPTSTATE_RETURN_IF_ERROR(s->ReleaseSnapshot("two"));
    }
    return s->CollectGarbage();
  }

  // One faulted run. Returns whether the rule fired.
  bool Run(const FaultRule& rule, const std::string& what, uint64_t* bytes) {
    Reset();
    FaultInjectionFileSystem fs(FileSystem::Default());
    fs.AddRule(rule);
    uint64_t acked = 1;
    Status err;
    {
      std::unique_ptr<Store> s;
      err = Workload(&fs, &acked, &s);
      if (rule.short_len.has_value()) {
        EXPECT_TRUE(err.ok()) << what << ": a short transfer must be resubmitted, got " << err.ToString();
      } else if (!err.ok()) {
        // A clear error: the injected cause survives the store's context.
        EXPECT_NE(err.message().find("injected fault"), std::string::npos) << what << ": " << err.ToString();
        if (s != nullptr) {
          fs.ClearRules();
          EXPECT_EQ(s->LatestGeneration().generation, acked) << what;
          auto view = s->OpenGeneration(vfs::kLatest);
          // After a failed fsync the store is poisoned (kDataLoss) until reopen: allowed.
          if (view.ok()) {
            EXPECT_TRUE(GenerationMatchesReference(**view, acked, bytes)) << what << " after " << err.ToString();
          } else {
            EXPECT_EQ(view.status().code(), StatusCode::kDataLoss) << what << ": " << view.status().ToString();
          }
        }
      }
    }
    const bool fired = fs.InjectedCount() > 0;
    CheckReopenedStore(path_, acked, err.ok() ? acked : acked + 1, bytes, what + " (error: " + err.ToString() + ")");
    return fired;
  }

  TempDir dir_;
  std::string path_, golden_;
};

TEST_F(FaultClassTest, FailNthOperationOfEachClassOnceAndPersistently) {
  uint64_t counts[8] = {};
  {
    Reset();
    FaultInjectionFileSystem fs(FileSystem::Default());
    uint64_t acked = 1;
    std::unique_ptr<Store> s;
    ASSERT_OK(Workload(&fs, &acked, &s));
    s.reset();
    for (int c = 0; c < 8; ++c) counts[c] = fs.OpCount(static_cast<OpClass>(c));
  }
  uint64_t bytes = 0, runs = 0, fired = 0;
  std::string summary;
  for (int c = 0; c < 8; ++c) {
    const OpClass op = static_cast<OpClass>(c);
    summary += std::string(vfs::OpClassName(op)) + "=" + std::to_string(counts[c]) + " ";
    for (uint64_t n = 1; n <= counts[c]; ++n) {
      std::vector<std::pair<FaultRule, std::string>> rules = {
          {FaultRule::FailNth(op, n, false), "once EIO"},
          {FaultRule::FailNth(op, n, true), "persistent EIO"},
      };
      if (op == OpClass::kWrite || op == OpClass::kFallocate || op == OpClass::kIndexWrite) {
        rules.push_back({FaultRule::FailNth(op, n, true, ENOSPC), "persistent ENOSPC"});
      }
      if (op == OpClass::kWrite || op == OpClass::kRead) {
        rules.push_back({FaultRule::ShortNth(op, n, 4096), "short 4096"});
      }
      for (const auto& [rule, kind] : rules) {
        const std::string what = std::string(vfs::OpClassName(op)) + " #" + std::to_string(n) + " " + kind;
        fired += Run(rule, what, &bytes);
        ++runs;
        if (HasFailure()) return;
      }
    }
  }
  std::printf("per-class faults: ops of a clean run: %s; %llu runs, %llu fired, %llu bytes compared\n",
              summary.c_str(), static_cast<unsigned long long>(runs), static_cast<unsigned long long>(fired),
              static_cast<unsigned long long>(bytes));
  EXPECT_GT(counts[static_cast<int>(OpClass::kIndexWrite)], 0u) << "RocksDB writes must go through the hooks";
  EXPECT_GT(counts[static_cast<int>(OpClass::kIndexSync)], 0u) << "RocksDB syncs must go through the hooks";
}

}  // namespace
}  // namespace optstate::reliability
