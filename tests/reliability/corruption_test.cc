// Corruption: flipped, zeroed and truncated bytes in the data extents and in
// every file of the store's RocksDB index (SST, MANIFEST, WAL, CURRENT,
// IDENTITY, OPTIONS) and the store's own IDENTITY. Allowed outcomes: Open
// fails with a message, or a read returns kCorruption naming tensor, field
// and chunk (and Verify reports it). Never: wrong bytes returned by
// Store/GenerationView reads, by the CheckpointLayout reader (what the mount
// and tools serve), or imported by RestoreCheckpoint. Every byte that IS
// returned is compared with the independent reference
// (tests/vfs/store_crash_workload.h).
#include <fcntl.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "tests/reliability/reliability_util.h"
#include "vfs/checkpoint.h"

namespace optstate::reliability {
namespace {

using vfs::ChunkRef;
using vfs::Store;
using wl::TempDir;
using wl::WorkloadOptions;
namespace fs = std::filesystem;

constexpr uint64_t kGens = 3;

// The reference bytes of (ti, f) in generation g, the whole field.
std::vector<uint8_t> ReferenceField(uint64_t g, uint32_t ti, uint32_t f) {
  const uint64_t bytes = wl::WorkloadTensors()[ti].numel * 4;
  std::vector<uint8_t> out(bytes);
  Buf b(kTestChunk);
  for (uint64_t c = 0; c * kTestChunk < bytes; ++c) {
    const uint64_t w = wl::WrittenAt(g, ti, f, c);
    if (w == 0) {
      std::memset(b.data(), 0, kTestChunk);
    } else {
      wl::FillPattern(b.data(), kTestChunk, wl::WorkloadSeed(w, ti, f, c));
    }
    std::memcpy(out.data() + c * kTestChunk, b.data(), std::min(kTestChunk, bytes - c * kTestChunk));
  }
  return out;
}

int TensorIndexOf(const std::string& name) {
  const auto& specs = wl::WorkloadTensors();
  for (size_t i = 0; i < specs.size(); ++i) {
    if (name == specs[i].name) return static_cast<int>(i);
  }
  return -1;
}

struct Outcome {
  bool open_failed = false;
  uint64_t corruption_errors = 0;  // reads that returned an error
  uint64_t bytes_ok = 0;           // bytes returned and equal to the reference
  uint64_t generation = 0;         // latest generation after reopen
};

// Everything a user can read from the store at `path`: every chunk of the
// latest generation, every field file through the CheckpointLayout. Each
// returned byte must equal the reference of the generation the view reports.
Outcome ReadEverything(const std::string& path, const std::string& what) {
  Outcome o;
  auto s = Store::Open(path, WorkloadOptions());
  if (!s.ok()) {
    EXPECT_FALSE(s.status().message().empty()) << what;
    o.open_failed = true;
    return o;
  }
  auto view = (*s)->OpenGeneration(vfs::kLatest);
  if (!view.ok()) {
    o.open_failed = true;
    return o;
  }
  const uint64_t g = (*view)->info().generation;
  o.generation = g;
  EXPECT_LE(g, kGens) << what;
  if (g < 1 || g > kGens) return o;
  Buf got(kTestChunk);
  for (const auto& t : (*view)->tensors()) {
    const int ti = TensorIndexOf(t.name);
    EXPECT_GE(ti, 0) << what << ": unknown tensor " << t.name;
    if (ti < 0) continue;
    for (uint32_t f = 0; f < 3; ++f) {
      const auto ref = ReferenceField(g, ti, f);
      for (uint64_t c = 0; c < (*view)->ChunkCount(t, f); ++c) {
        Status st = (*view)->ReadChunk(ChunkRef{t.id, f, c}, got.data());
        const uint64_t len = std::min(kTestChunk, ref.size() - c * kTestChunk);
        if (!st.ok()) {
          ++o.corruption_errors;
          // A corrupt extent must be named: tensor, field and chunk.
          if (st.code() == StatusCode::kCorruption) {
            EXPECT_NE(st.message().find(t.name), std::string::npos) << what << ": " << st.ToString();
            EXPECT_NE(st.message().find("chunk"), std::string::npos) << what << ": " << st.ToString();
          }
          continue;
        }
        EXPECT_EQ(0, std::memcmp(got.data(), ref.data() + c * kTestChunk, len))
            << what << ": WRONG BYTES from ReadChunk: generation " << g << " " << t.name << " field " << f
            << " chunk " << c;
        o.bytes_ok += len;
      }
    }
  }
  // The checkpoint layout reader (what optstate-mount and the tools serve).
  auto layout = vfs::CheckpointLayout::Build(view->get());
  if (layout.ok()) {
    for (const auto& file : (*layout)->files()) {
      if (file.kind != vfs::CheckpointFileKind::kField) continue;
      const auto& t = (*view)->tensors()[file.tensor_index];
      const int ti = TensorIndexOf(t.name);
      if (ti < 0) continue;
      const auto ref = ReferenceField(g, ti, file.field);
      std::vector<uint8_t> buf(file.size_bytes);
      auto n = (*layout)->Read(file, 0, buf.data(), buf.size());
      if (!n.ok()) {
        ++o.corruption_errors;
        continue;
      }
      EXPECT_EQ(*n, ref.size()) << what << " " << file.path;
      EXPECT_TRUE(*n == ref.size() && std::memcmp(buf.data(), ref.data(), ref.size()) == 0)
          << what << ": WRONG BYTES from CheckpointLayout::Read " << file.path;
      o.bytes_ok += *n;
    }
  }
  auto rep = (*s)->Verify();
  if (o.corruption_errors > 0 && rep.ok()) {
    EXPECT_FALSE(rep->problems.empty()) << what << ": reads failed but Verify is clean";
  }
  return o;
}

class CorruptionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = dir_ / "store";
    golden_ = dir_ / "golden";
    auto s = Store::Create(path_, WorkloadOptions());
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    for (uint64_t g = 1; g <= kGens; ++g) {
      auto c = CommitWorkloadGeneration(s->get(), g);
      ASSERT_TRUE(c.ok()) << c.status().ToString();
    }
    s->reset();
    fs::copy(path_, golden_, fs::copy_options::recursive);
  }
  void Reset() {
    fs::remove_all(path_);
    fs::copy(golden_, path_, fs::copy_options::recursive);
  }
  TempDir dir_;
  std::string path_, golden_;
};

void PatchFile(const std::string& file, uint64_t off, const std::vector<uint8_t>& bytes) {
  const int fd = ::open(file.c_str(), O_WRONLY);
  ASSERT_GE(fd, 0) << file;
  ASSERT_EQ(::pwrite(fd, bytes.data(), bytes.size(), static_cast<off_t>(off)), static_cast<ssize_t>(bytes.size()));
  ::close(fd);
}
uint8_t ByteAt(const std::string& file, uint64_t off) {
  std::ifstream in(file, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(off));
  char c = 0;
  in.get(c);
  return static_cast<uint8_t>(c);
}

TEST_F(CorruptionTest, ExtentsFlippedZeroedTruncated) {
  // Where the latest generation's written chunks live.
  struct Target {
    std::string tensor;
    uint32_t field;
    uint64_t chunk;
    uint64_t file_offset, len;
    uint32_t dir;
  };
  std::vector<Target> targets;
  {
    auto s = Store::Open(path_, WorkloadOptions());
    ASSERT_TRUE(s.ok());
    auto v = (*s)->OpenGeneration(vfs::kLatest);
    ASSERT_TRUE(v.ok());
    for (const auto& t : (*v)->tensors()) {
      for (uint32_t f = 0; f < 3; ++f) {
        for (uint64_t c = 0; c < (*v)->ChunkCount(t, f); ++c) {
          auto ci = (*v)->Chunk(ChunkRef{t.id, f, c});
          ASSERT_TRUE(ci.ok());
          if (!ci->zero) targets.push_back({t.name, f, c, ci->file_offset, ci->length_bytes, ci->data_dir});
        }
      }
    }
  }
  ASSERT_GE(targets.size(), 4u);
  const auto data_dir = fs::path(path_) / "data";
  std::string data_file;
  for (const auto& e : fs::directory_iterator(data_dir)) {
    if (e.path().extension() == ".chunks") data_file = e.path().string();  // not <uuid>.owner
  }
  ASSERT_FALSE(data_file.empty());
  uint64_t cases = 0, bytes = 0, open_failed = 0;
  for (const auto& t : targets) {
    for (int kind = 0; kind < 4; ++kind) {
      Reset();
      std::string what = t.tensor + " field " + std::to_string(t.field) + " chunk " + std::to_string(t.chunk);
      if (kind == 0) {  // one flipped bit at the start
        PatchFile(data_file, t.file_offset, {static_cast<uint8_t>(ByteAt(data_file, t.file_offset) ^ 1)});
        what += " flipped first byte";
      } else if (kind == 1) {  // flipped last logical byte
        const uint64_t o = t.file_offset + t.len - 1;
        PatchFile(data_file, o, {static_cast<uint8_t>(ByteAt(data_file, o) ^ 0x80)});
        what += " flipped last byte";
      } else if (kind == 2) {  // a zeroed 4 KiB block
        PatchFile(data_file, t.file_offset + (t.len / 2) / 4096 * 4096,
                  std::vector<uint8_t>(std::min<uint64_t>(4096, t.len), 0));
        what += " zeroed 4 KiB";
      } else {  // data file truncated inside the extent
        fs::resize_file(data_file, t.file_offset + t.len / 2);
        what += " data file truncated";
      }
      Outcome o = ReadEverything(path_, what);
      if (kind == 3 && o.open_failed) {
        ++open_failed;  // a data file shorter than its extents: Open refuses (loudly)
      } else {
        EXPECT_FALSE(o.open_failed) << what << ": a bad extent must not stop Open";
        EXPECT_EQ(o.generation, kGens) << what;
        EXPECT_GE(o.corruption_errors, 1u) << what << ": corruption went unnoticed";
      }
      bytes += o.bytes_ok;
      ++cases;
      if (HasFailure()) return;
    }
  }
  std::printf("extent corruption: %llu cases (%llu truncations refused at Open), %llu correct bytes compared, "
              "0 wrong\n",
              static_cast<unsigned long long>(cases), static_cast<unsigned long long>(open_failed),
              static_cast<unsigned long long>(bytes));
}

TEST_F(CorruptionTest, IndexAndIdentityFilesFlippedZeroedTruncated) {
  std::vector<std::string> files;
  for (const auto& e : fs::recursive_directory_iterator(golden_)) {
    if (!e.is_regular_file()) continue;
    const std::string rel = fs::relative(e.path(), golden_).string();
    if (rel.rfind("index/", 0) == 0 || rel == "IDENTITY") {
      if (rel.find("/LOG") != std::string::npos || rel.find("/LOCK") != std::string::npos) continue;
      files.push_back(rel);
    }
  }
  ASSERT_GE(files.size(), 4u);
  uint64_t cases = 0, open_failed = 0, read_errors = 0, clean = 0, bytes = 0, rollbacks = 0;
  std::string summary, rolled;
  for (const auto& rel : files) {
    const uint64_t size = fs::file_size(fs::path(golden_) / rel);
    std::vector<std::pair<std::string, std::function<void(const std::string&)>>> muts;
    for (uint64_t off : {uint64_t{0}, size / 3, size / 2, size > 0 ? size - 1 : 0}) {
      if (size == 0) break;
      muts.push_back({"flip@" + std::to_string(off), [off](const std::string& p) {
                        PatchFile(p, off, {static_cast<uint8_t>(ByteAt(p, off) ^ 0x10)});
                      }});
    }
    if (size > 0) {
      muts.push_back({"zero4k@mid", [size](const std::string& p) {
                        const uint64_t off = size / 2 / 4096 * 4096;
                        PatchFile(p, off, std::vector<uint8_t>(std::min<uint64_t>(4096, size - off), 0));
                      }});
    }
    muts.push_back({"truncate-half", [size](const std::string& p) { fs::resize_file(p, size / 2); }});
    muts.push_back({"truncate-0", [](const std::string& p) { fs::resize_file(p, 0); }});
    for (const auto& [name, mutate] : muts) {
      Reset();
      mutate((fs::path(path_) / rel).string());
      const std::string what = rel + " " + name;
      Outcome o = ReadEverything(path_, what);
      ++cases;
      bytes += o.bytes_ok;
      if (!o.open_failed && o.generation < kGens) {
        ++rollbacks;
        rolled += what + " -> generation " + std::to_string(o.generation) + "; ";
      }
      if (o.open_failed) {
        ++open_failed;
      } else if (o.corruption_errors > 0) {
        ++read_errors;
      } else {
        ++clean;
        summary += what + "; ";
      }
      if (HasFailure()) return;
    }
  }
  std::printf("index corruption: %zu files, %llu cases: open failed %llu, read errors %llu, "
              "no visible effect (correct bytes) %llu; %llu correct bytes compared, 0 wrong\n"
              "no-effect cases: %s\n",
              files.size(), static_cast<unsigned long long>(cases), static_cast<unsigned long long>(open_failed),
              static_cast<unsigned long long>(read_errors), static_cast<unsigned long long>(clean),
              static_cast<unsigned long long>(bytes), summary.c_str());
  // BUG (docs/RELIABILITY.md "Bugs found"): a damaged WAL record makes RocksDB
  // (wal_recovery_mode kPointInTimeRecovery, the default) stop replay there
  // and open cleanly at an OLDER generation: acknowledged generations vanish
  // without an error. Fix in vfs/store_open.cc: open the index with
  // wal_recovery_mode = kTolerateCorruptedTailRecords (a torn last record after
  // a crash is still fine; corruption before it fails Open loudly).
  EXPECT_EQ(rollbacks, 0u) << "silent rollback to an older generation: " << rolled;
}

// A checkpoint exported through the layout, then damaged on disk: restore
// refuses it (naming the file) and the target store is unchanged.
TEST_F(CorruptionTest, RestoreRefusesDamagedCheckpoint) {
  const std::string ckpt = dir_ / "ckpt";
  {
    auto s = Store::Open(path_, WorkloadOptions());
    ASSERT_TRUE(s.ok());
    auto v = (*s)->OpenGeneration(vfs::kLatest);
    ASSERT_TRUE(v.ok());
    auto layout = vfs::CheckpointLayout::Build(v->get());
    ASSERT_TRUE(layout.ok()) << layout.status().ToString();
    for (const auto& f : (*layout)->files()) {
      const fs::path p = fs::path(ckpt) / f.path;
      fs::create_directories(p.parent_path());
      std::vector<char> buf(f.size_bytes);
      auto n = (*layout)->Read(f, 0, buf.data(), buf.size());
      ASSERT_TRUE(n.ok() && *n == f.size_bytes) << f.path;
      std::ofstream(p, std::ios::binary).write(buf.data(), static_cast<std::streamsize>(buf.size()));
    }
  }
  std::vector<std::string> field_files;
  for (const auto& e : fs::recursive_directory_iterator(fs::path(ckpt) / "tensors")) {
    if (e.is_regular_file() && fs::file_size(e.path()) > 0) field_files.push_back(e.path().string());
  }
  ASSERT_FALSE(field_files.empty());
  const std::string pristine = dir_ / "ckpt-pristine";
  fs::copy(ckpt, pristine, fs::copy_options::recursive);
  uint64_t cases = 0;
  for (const auto& file : field_files) {
    const uint64_t size = fs::file_size(file);
    for (int kind = 0; kind < 3; ++kind) {
      fs::remove_all(ckpt);
      fs::copy(pristine, ckpt, fs::copy_options::recursive);
      if (kind == 0) PatchFile(file, size / 2, {static_cast<uint8_t>(ByteAt(file, size / 2) ^ 4)});
      if (kind == 1) PatchFile(file, 0, std::vector<uint8_t>(std::min<uint64_t>(size, 4096), 0));
      if (kind == 2) fs::resize_file(file, size - 1);
      const std::string what = file + " kind " + std::to_string(kind);
      // Restore into a fresh copy of the store (generation 3).
      Reset();
      auto s = Store::Open(path_, WorkloadOptions());
      ASSERT_TRUE(s.ok());
      auto r = vfs::RestoreCheckpoint(s->get(), ckpt);
      // A flip/zero in a never-written (all-zero) chunk region can be a no-op for zero kind.
      if (r.ok()) {
        // Allowed only when the damage did not change the bytes (zeroing zeros).
        EXPECT_EQ(kind, 1) << what << ": restore accepted a damaged checkpoint";
      } else {
        EXPECT_NE(r.status().message().find(fs::path(file).filename().string()), std::string::npos)
            << what << ": error does not name the file: " << r.status().ToString();
        EXPECT_EQ((*s)->LatestGeneration().generation, kGens) << what;
      }
      auto v = (*s)->OpenGeneration(vfs::kLatest);
      ASSERT_TRUE(v.ok());
      if (!r.ok()) {
        EXPECT_TRUE(GenerationMatchesReference(**v, kGens, nullptr)) << what;
      }
      ++cases;
      if (HasFailure()) return;
    }
  }
  std::printf("damaged checkpoints refused by restore: %llu cases\n", static_cast<unsigned long long>(cases));
}

}  // namespace
}  // namespace optstate::reliability
