// ExportCheckpoint: the directory it writes is byte for byte the layout the
// mount serves (CheckpointLayout::Read, written by WriteCheckpointDir), restores
// bit for bit, and appears at dest complete or not at all: an I/O error or a
// SIGKILL mid-export leaves no dest, an existing non-empty dest is refused.
// Without state.safetensors it writes the same field files and restores the same.
// Chunks a ChunkSource fills with the generation's bytes are taken from it,
// others (and any it fills with other bytes) from the disk: the same files.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>

#include <spdlog/sinks/ostream_sink.h>

#include "tests/common/test_util.h"
#include "base/log.h"
#include "tests/vfs/checkpoint_test_util.h"
#include "vfs/checkpoint.h"
#include "vfs/fault_injection.h"

namespace optstate::vfs {
namespace {

using namespace testing;  // NOLINT
namespace fs = std::filesystem;

constexpr const char* kChildEnv = "OPTSTATE_EXPORT_CHILD";  // "<store>|<dest>" for the child below

// Every file under root, by relative path, with its bytes.
std::map<std::string, std::string> Tree(const std::string& root) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(root)) {
    if (e.is_regular_file()) out[fs::relative(e.path(), root).string()] = ReadFile(e.path().string());
  }
  return out;
}

std::vector<std::string> Entries(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// The warnings the library logs while it lives (at least warn level, whatever
// OPTSTATE_LOG_LEVEL says). Made and destroyed while no other thread logs.
class WarningCapture {
 public:
  WarningCapture() : sink_(std::make_shared<spdlog::sinks::ostream_sink_mt>(out_)), level_(Logger().level()) {
    sink_->set_level(spdlog::level::warn);
    if (level_ > spdlog::level::warn) Logger().set_level(spdlog::level::warn);
    Logger().sinks().push_back(sink_);
  }
  ~WarningCapture() {
    auto& sinks = Logger().sinks();
    sinks.erase(std::remove(sinks.begin(), sinks.end(), sink_), sinks.end());
    Logger().set_level(level_);
  }
  std::string Text() {
    sink_->flush();
    return out_.str();
  }

 private:
  std::ostringstream out_;
  std::shared_ptr<spdlog::sinks::ostream_sink_mt> sink_;
  spdlog::level::level_enum level_;
};

uint64_t TotalBytes(const std::map<std::string, std::string>& tree) {
  uint64_t n = 0;
  for (const auto& [path, bytes] : tree) n += bytes.size();
  return n;
}

class ExportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = MakeTempDir("export");
    store_ = CreateStore(root_ + "/store");
    ASSERT_NE(store_, nullptr);
    CreateTensors(store_.get(), DefaultTensors());
    gen1_ = WriteStep(store_.get(), 11, /*sparse=*/true);  // some chunks never written: zeros
    auto v = store_->OpenGeneration(kLatest);
    ASSERT_TRUE(v.ok());
    want_ = DumpView(**v);
    mount_view_ = root_ + "/mount_view";
    WriteCheckpointDir(**v, mount_view_);
  }
  void TearDown() override {
    store_.reset();
    fs::remove_all(root_);
  }

  std::string root_, mount_view_;
  std::unique_ptr<Store> store_;
  uint64_t gen1_ = 0;
  std::map<std::string, std::string> want_;
};

TEST_F(ExportTest, EqualsTheMountsFilesAndRestoresBitExact) {
  ASSERT_TRUE(store_->CreateSnapshot("s").ok());
  WriteStep(store_.get(), 12);  // latest moves on; the snapshot still names gen1_
  ExportOptions o;
  o.snapshot = "s";
  o.queue_depth = 3;  // fewer buffers than chunks: buffers are reused across files
  uint64_t progress_calls = 0, last_done = 0, last_total = 0;
  o.progress = [&](uint64_t done, uint64_t total) {
    ++progress_calls;
    EXPECT_GE(done, last_done);
    last_done = done, last_total = total;
  };
  auto r = ExportCheckpoint(store_.get(), root_ + "/out", o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->generation, gen1_);
  EXPECT_TRUE(Tree(root_ + "/out") == Tree(mount_view_)) << "exported bytes differ from the layout's";
  EXPECT_EQ(r->files, Tree(mount_view_).size());
  EXPECT_GT(progress_calls, 0u);
  EXPECT_EQ(last_done, last_total);
  EXPECT_EQ(Entries(root_), (std::vector<std::string>{"mount_view", "out", "store"}));  // no partial left
  auto b = CreateStoreFromCheckpoint(root_ + "/out", root_ + "/fresh", StoreOptions{});
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_TRUE(DumpLatest(b->get()) == want_);

  // The newest generation (the default), into an existing empty directory.
  auto latest = store_->OpenGeneration(kLatest);
  ASSERT_TRUE(latest.ok());
  WriteCheckpointDir(**latest, root_ + "/latest_view");
  fs::create_directory(root_ + "/empty");
  auto r2 = ExportCheckpoint(store_.get(), root_ + "/empty/");
  ASSERT_TRUE(r2.ok()) << r2.status().ToString();
  EXPECT_EQ(r2->generation, store_->LatestGeneration().generation);
  EXPECT_NE(r2->generation, gen1_);
  EXPECT_TRUE(Tree(root_ + "/empty") == Tree(root_ + "/latest_view"));
}

// safetensors = false: the default export less state.safetensors, a manifest
// that says so, and a restore that reads the field files alone, as strictly.
TEST_F(ExportTest, WithoutSafetensorsWritesTheFieldFilesOnce) {
  const std::string full = root_ + "/full", lean = root_ + "/lean";
  auto rf = ExportCheckpoint(store_.get(), full);
  ASSERT_TRUE(rf.ok()) << rf.status().ToString();
  ExportOptions o;
  o.safetensors = false;
  auto rl = ExportCheckpoint(store_.get(), lean, o);
  ASSERT_TRUE(rl.ok()) << rl.status().ToString();
  EXPECT_EQ(rl->generation, rf->generation);

  const auto full_tree = Tree(full), lean_tree = Tree(lean);
  ASSERT_TRUE(full_tree.count(kSafetensorsFileName));
  EXPECT_FALSE(fs::exists(lean + "/" + kSafetensorsFileName));
  // Every field file byte for byte the default export's (and the mount's); nothing else but the manifest.
  std::map<std::string, std::string> full_fields = full_tree, lean_fields = lean_tree;
  full_fields.erase(kSafetensorsFileName);
  full_fields.erase(kManifestFileName);
  lean_fields.erase(kManifestFileName);
  EXPECT_EQ(lean_tree.size(), full_tree.size() - 1);
  EXPECT_TRUE(lean_fields == full_fields) << "field files differ from the default export's";
  // The manifest: the default one, marked. Parsed and unmarked, it serialises to the default's bytes.
  const std::string& lean_manifest = lean_tree.at(kManifestFileName);
  const std::string& full_manifest = full_tree.at(kManifestFileName);
  EXPECT_NE(lean_manifest.find("\"state_safetensors\": false"), std::string::npos) << lean_manifest;
  EXPECT_EQ(full_manifest.find("state_safetensors"), std::string::npos);
  auto lm = ReadManifestFile(lean + "/" + kManifestFileName);
  ASSERT_TRUE(lm.ok()) << lm.status().ToString();
  EXPECT_FALSE(lm->has_safetensors);
  auto fm = ReadManifestFile(full + "/" + kManifestFileName);
  ASSERT_TRUE(fm.ok()) << fm.status().ToString();
  EXPECT_TRUE(fm->has_safetensors);
  lm->has_safetensors = true;
  EXPECT_EQ(SerializeManifest(*lm), full_manifest);
  // The key is typed like every other: a non-boolean is refused naming it.
  std::string typo = lean_manifest;
  typo.replace(typo.find("\"state_safetensors\": false"), 26, "\"state_safetensors\": 0");
  auto bad_key = ParseManifest(typo, "typo");
  ASSERT_FALSE(bad_key.ok());
  EXPECT_NE(bad_key.status().message().find("key 'state_safetensors'"), std::string::npos)
      << bad_key.status().message();
  // Bytes: the default's less state.safetensors, give or take the manifest's key.
  EXPECT_EQ(TotalBytes(lean_tree) - lean_manifest.size(),
            TotalBytes(full_tree) - full_tree.at(kSafetensorsFileName).size() - full_manifest.size());
  EXPECT_EQ(rl->bytes, TotalBytes(lean_tree));
  EXPECT_EQ(rf->bytes, TotalBytes(full_tree));
  EXPECT_EQ(rl->files, lean_tree.size());

  // Restores bit for bit (the source store's values), and with no warning: it is no damage.
  {
    WarningCapture warnings;
    auto b = CreateStoreFromCheckpoint(lean, root_ + "/fresh", StoreOptions{});
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    EXPECT_TRUE(DumpLatest(b->get()) == want_);
    EXPECT_EQ((*b)->LatestGeneration().step, 11u);
    EXPECT_EQ(warnings.Text(), "");
  }
  // A default checkpoint that lost its state.safetensors restores as before: with a warning.
  fs::remove(full + "/" + kSafetensorsFileName);
  {
    WarningCapture warnings;
    auto b = CreateStoreFromCheckpoint(full, root_ + "/fresh2", StoreOptions{});
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    EXPECT_TRUE(DumpLatest(b->get()) == want_);
    EXPECT_NE(warnings.Text().find(full + "/" + kSafetensorsFileName + " is missing"), std::string::npos)
        << warnings.Text();
  }
  // A state.safetensors beside a manifest that says there is none is not read: even a damaged one.
  {
    std::ofstream(lean + "/" + kSafetensorsFileName) << "not a safetensors file";
    WarningCapture warnings;
    auto b = CreateStoreFromCheckpoint(lean, root_ + "/fresh3", StoreOptions{});
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    EXPECT_TRUE(DumpLatest(b->get()) == want_);
    EXPECT_NE(warnings.Text().find(lean + "/" + kSafetensorsFileName + " is ignored"), std::string::npos)
        << warnings.Text();
    fs::remove(lean + "/" + kSafetensorsFileName);
  }
  // A damaged field file is refused naming it, its tensor, field and chunk: the manifest's XXH3 guards it.
  {
    std::fstream f(lean + "/tensors/layers.0%2Fw/main", std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(2 * kMiB + 100);
    const char was = static_cast<char>(f.get());
    f.seekp(2 * kMiB + 100);
    f.put(static_cast<char>(was ^ 0x20));
  }
  auto bad = CreateStoreFromCheckpoint(lean, root_ + "/fresh4", StoreOptions{});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kCorruption) << bad.status().ToString();
  for (const char* part : {"tensors/layers.0%2Fw/main", "'layers.0/w'", "'main'", "chunk 1", "XXH3"}) {
    EXPECT_NE(bad.status().message().find(part), std::string::npos) << part << " not in " << bad.status().message();
  }
  EXPECT_FALSE(fs::exists(root_ + "/fresh4"));
  // Into an existing store that has taken steps: refused the same way, the store unchanged.
  WriteStep(store_.get(), 12);
  const auto before = DumpLatest(store_.get());
  const uint64_t head = store_->LatestGeneration().generation;
  auto into = RestoreCheckpoint(store_.get(), lean);
  ASSERT_FALSE(into.ok());
  EXPECT_NE(into.status().message().find("chunk 1"), std::string::npos) << into.status().message();
  EXPECT_EQ(store_->LatestGeneration().generation, head);
  EXPECT_TRUE(DumpLatest(store_.get()) == before);
}

// A ChunkSource over copies of the chunks of one generation, read from a
// view: fills each chunk as `fill` says (kRight: the copy, kWrong: another
// version's bytes, kNone: declines).
class CopiesSource : public ChunkSource {
 public:
  enum class Give { kRight, kWrong, kNone };
  CopiesSource(const GenerationView& right, const GenerationView& wrong, std::function<Give(const ChunkRef&)> fill)
      : fill_(std::move(fill)) {
    Copy(right, &right_);
    Copy(wrong, &wrong_);
  }
  bool Fill(const ChunkRef& ref, void* dst, uint64_t len) override {
    ++calls;
    const auto key = std::make_tuple(ref.tensor_id, ref.field, ref.index);
    const Give how = fill_(ref);
    if (how == Give::kNone) return false;
    const std::string& bytes = (how == Give::kRight ? right_ : wrong_).at(key);
    EXPECT_EQ(bytes.size(), len);
    std::memcpy(dst, bytes.data(), std::min<uint64_t>(len, bytes.size()));
    return true;
  }
  uint64_t calls = 0;

 private:
  using Key = std::tuple<uint32_t, uint32_t, uint64_t>;
  static void Copy(const GenerationView& v, std::map<Key, std::string>* out) {
    AlignedChunk buf(v.identity().chunk_size_bytes);
    for (const TensorInfo& t : v.tensors()) {
      for (uint32_t f = 0; f < t.fields.size(); ++f) {
        for (uint64_t c = 0; c < v.ChunkCount(t, f); ++c) {
          auto ci = v.Chunk(ChunkRef{t.id, f, c});
          ASSERT_TRUE(ci.ok());
          ASSERT_TRUE(v.ReadChunk(ChunkRef{t.id, f, c}, buf.p).ok());
          (*out)[Key{t.id, f, c}] = std::string(buf.p, ci->length_bytes);
        }
      }
    }
  }
  std::function<Give(const ChunkRef&)> fill_;
  std::map<Key, std::string> right_, wrong_;
};

// Chunks of a view that have been written (and their logical bytes).
std::pair<uint64_t, uint64_t> WrittenChunks(const GenerationView& v) {
  uint64_t n = 0, bytes = 0;
  for (const TensorInfo& t : v.tensors()) {
    for (uint32_t f = 0; f < t.fields.size(); ++f) {
      for (uint64_t c = 0; c < v.ChunkCount(t, f); ++c) {
        auto ci = v.Chunk(ChunkRef{t.id, f, c});
        EXPECT_TRUE(ci.ok());
        if (ci.ok() && !ci->zero) ++n, bytes += ci->length_bytes;
      }
    }
  }
  return {n, bytes};
}

// A source that holds every chunk: the checkpoint is the one read from the
// disk, byte for byte, and no chunk is read from the disk.
TEST_F(ExportTest, ChunkSourceFillingEveryChunkWritesTheSameCheckpoint) {
  auto gen = store_->OpenGeneration(kLatest);
  ASSERT_TRUE(gen.ok());
  const auto [written, written_bytes] = WrittenChunks(**gen);
  ASSERT_GT(written, 4u);
  CopiesSource src(**gen, **gen, [](const ChunkRef&) { return CopiesSource::Give::kRight; });
  for (bool st : {true, false}) {
    SCOPED_TRACE(st ? "with state.safetensors" : "without state.safetensors");
    const std::string plain = root_ + (st ? "/plain" : "/plain_lean"), ram = root_ + (st ? "/ram" : "/ram_lean");
    ExportOptions o;
    o.safetensors = st;
    o.queue_depth = 3;
    auto rp = ExportCheckpoint(store_.get(), plain, o);
    ASSERT_TRUE(rp.ok()) << rp.status().ToString();
    EXPECT_EQ(rp->source_chunks, 0u);
    EXPECT_EQ(rp->disk_chunks, written);
    o.chunk_source = &src;
    auto rr = ExportCheckpoint(store_.get(), ram, o);
    ASSERT_TRUE(rr.ok()) << rr.status().ToString();
    EXPECT_TRUE(Tree(ram) == Tree(plain)) << "the source's checkpoint differs from the disk's";
    EXPECT_EQ(rr->bytes, rp->bytes);
    EXPECT_EQ(rr->files, rp->files);
    EXPECT_EQ(rr->source_chunks, written);
    EXPECT_EQ(rr->source_bytes, written_bytes);
    EXPECT_EQ(rr->source_mismatches, 0u);
    EXPECT_EQ(rr->disk_chunks, 0u);
    EXPECT_EQ(rr->disk_bytes, 0u);
  }
  EXPECT_TRUE(Tree(root_ + "/ram") == Tree(mount_view_));
  EXPECT_EQ(src.calls, 2 * written);  // never asked for a chunk never written
}

// A source holding a newer version of some chunks (and nothing of others):
// those are read from the disk, counted, and the checkpoint is the exported
// generation's, restored bit for bit.
TEST_F(ExportTest, ChunkSourceWithOtherBytesFallsBackToTheDisk) {
  ASSERT_TRUE(store_->CreateSnapshot("s").ok());
  WriteStep(store_.get(), 12);  // every chunk has a newer version now
  auto old_gen = store_->OpenSnapshot("s");
  auto new_gen = store_->OpenGeneration(kLatest);
  ASSERT_TRUE(old_gen.ok() && new_gen.ok());
  const auto [written, written_bytes] = WrittenChunks(**old_gen);
  auto how = [](const ChunkRef& r) {
    switch ((r.tensor_id + r.field + r.index) % 3) {
      case 0: return CopiesSource::Give::kRight;
      case 1: return CopiesSource::Give::kWrong;
      default: return CopiesSource::Give::kNone;
    }
  };
  uint64_t right = 0, wrong = 0, none = 0;
  for (const TensorInfo& t : (*old_gen)->tensors()) {
    for (uint32_t f = 0; f < t.fields.size(); ++f) {
      for (uint64_t c = 0; c < (*old_gen)->ChunkCount(t, f); ++c) {
        const ChunkRef ref{t.id, f, c};
        if ((*old_gen)->Chunk(ref)->zero) continue;
        const auto h = how(ref);
        (h == CopiesSource::Give::kRight ? right : h == CopiesSource::Give::kWrong ? wrong : none)++;
      }
    }
  }
  ASSERT_GT(right, 0u);
  ASSERT_GT(wrong, 0u);
  ASSERT_GT(none, 0u);
  CopiesSource src(**old_gen, **new_gen, how);
  ExportOptions o;
  o.snapshot = "s";
  o.queue_depth = 2;
  o.chunk_source = &src;
  auto r = ExportCheckpoint(store_.get(), root_ + "/out", o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->generation, gen1_);
  EXPECT_TRUE(Tree(root_ + "/out") == Tree(mount_view_)) << "a wrong chunk from the source reached the checkpoint";
  EXPECT_EQ(r->source_chunks, right);
  EXPECT_EQ(r->source_mismatches, wrong);
  EXPECT_EQ(r->disk_chunks, wrong + none);
  EXPECT_EQ(r->source_bytes + r->disk_bytes, written_bytes);
  auto b = CreateStoreFromCheckpoint(root_ + "/out", root_ + "/fresh", StoreOptions{});
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_TRUE(DumpLatest(b->get()) == want_);
}

TEST_F(ExportTest, RefusesExistingDestAndMissingSources) {
  fs::create_directory(root_ + "/full");
  std::ofstream(root_ + "/full/keep") << "mine";
  auto r = ExportCheckpoint(store_.get(), root_ + "/full");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kAlreadyExists);
  EXPECT_NE(r.status().message().find(root_ + "/full"), std::string::npos) << r.status().message();
  EXPECT_EQ(ReadFile(root_ + "/full/keep"), "mine");
  std::ofstream(root_ + "/file") << "x";
  EXPECT_EQ(ExportCheckpoint(store_.get(), root_ + "/file").status().code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(ExportCheckpoint(store_.get(), root_ + "/no/parent").status().code(), StatusCode::kNotFound);
  ExportOptions o;
  o.snapshot = "nope";
  auto r2 = ExportCheckpoint(store_.get(), root_ + "/x", o);
  EXPECT_EQ(r2.status().code(), StatusCode::kNotFound) << r2.status().ToString();
  EXPECT_EQ(Entries(root_), (std::vector<std::string>{"file", "full", "mount_view", "store"}));
}

TEST_F(ExportTest, WriteErrorLeavesNoDest) {
  FaultInjectionFileSystem ffs(FileSystem::Default());
  for (uint64_t nth : {1, 2, 7}) {  // the manifest, the safetensors header, a chunk of a field
    FaultRule rule = FaultRule::FailNth(OpClass::kWrite, nth);
    rule.path_contains = root_ + "/out";
    ffs.AddRule(rule);
    ExportOptions o;
    o.fs = &ffs;
    auto r = ExportCheckpoint(store_.get(), root_ + "/out", o);
    ASSERT_FALSE(r.ok()) << "write " << nth;
    EXPECT_NE(r.status().message().find("export: store " + root_ + "/store"), std::string::npos)
        << r.status().message();
    EXPECT_EQ(Entries(root_), (std::vector<std::string>{"mount_view", "store"})) << "write " << nth;
    ffs.ClearRules();
  }
  ExportOptions o;
  o.fs = &ffs;
  ASSERT_TRUE(ExportCheckpoint(store_.get(), root_ + "/out", o).ok());
  EXPECT_TRUE(Tree(root_ + "/out") == Tree(mount_view_));
}

// An export that returned is durable: power lost right after it (every
// byte not yet synced gone) leaves the whole checkpoint, with and without
// state.safetensors.
TEST_F(ExportTest, PowerLossAfterItReturnsLosesNothing) {
  for (bool with_st : {true, false}) {
    FaultInjectionFileSystem ffs(FileSystem::Default());
    ExportOptions o;
    o.fs = &ffs;
    o.safetensors = with_st;
    const std::string out = root_ + (with_st ? "/out" : "/lean");
    ASSERT_TRUE(ExportCheckpoint(store_.get(), out, o).ok());
    EXPECT_EQ(ffs.UnsyncedBytes(), 0u) << "safetensors " << with_st;
    EXPECT_TRUE(ffs.UnsyncedCreations().empty()) << "safetensors " << with_st;
    ASSERT_TRUE(ffs.DropUnsyncedData(DropMode::kAll).ok());
    if (with_st) {
      EXPECT_TRUE(Tree(out) == Tree(mount_view_));
    } else {
      auto field_files = Tree(mount_view_);
      field_files.erase(kSafetensorsFileName);
      field_files.erase(kManifestFileName);
      auto lean = Tree(out);
      lean.erase(kManifestFileName);
      EXPECT_TRUE(lean == field_files);
    }
  }
}

// Run by CrashLeavesNoDest in a child process: exports, and is killed by OPTSTATE_CRASH_AT.
TEST(ExportChild, DISABLED_Run) {
  const char* env = std::getenv(kChildEnv);
  ASSERT_NE(env, nullptr);
  const std::string arg(env);
  const size_t bar = arg.find('|');
  auto store = Store::Open(arg.substr(0, bar), StoreOptions{});
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  auto r = ExportCheckpoint(store->get(), arg.substr(bar + 1));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  std::printf("EXPORTED\n");
}

TEST_F(ExportTest, CrashLeavesNoDest) {
  store_.reset();  // the child opens it
  for (const char* point : {"export.after_chunk:3", "export.before_rename"}) {
    const std::string dest = root_ + "/out";
    ::setenv(kChildEnv, (root_ + "/store|" + dest).c_str(), 1);
    test_util::ChildOptions co;
    co.exe = "/proc/self/exe";
    co.args = {"--gtest_filter=ExportChild.DISABLED_Run", "--gtest_also_run_disabled_tests"};
    co.crash_at = point;
    test_util::ChildResult res = test_util::RunChild(co);
    ::unsetenv(kChildEnv);
    ASSERT_TRUE(WIFSIGNALED(res.wait_status) && WTERMSIG(res.wait_status) == SIGKILL)
        << point << ": the child was not killed there:\n" << res.output;
    EXPECT_FALSE(fs::exists(dest)) << point;
    // What a crash leaves: the partial directory only.
    bool partial = false;
    for (const std::string& n : Entries(root_)) {
      if (n.rfind("out.partial-", 0) == 0) {
        partial = true;
        fs::remove_all(root_ + "/" + n);
      }
    }
    EXPECT_TRUE(partial) << point;
  }
  // Without a crash point the child's export completes.
  ::setenv(kChildEnv, (root_ + "/store|" + root_ + "/out").c_str(), 1);
  test_util::ChildOptions co;
  co.exe = "/proc/self/exe";
  co.args = {"--gtest_filter=ExportChild.DISABLED_Run", "--gtest_also_run_disabled_tests"};
  test_util::ChildResult res = test_util::RunChild(co);
  ::unsetenv(kChildEnv);
  ASSERT_TRUE(WIFEXITED(res.wait_status) && WEXITSTATUS(res.wait_status) == 0) << res.output;
  EXPECT_TRUE(Tree(root_ + "/out") == Tree(mount_view_));
}

}  // namespace
}  // namespace optstate::vfs
