// optstate-restore as a user runs it, and docs/CHECKPOINT.md's reader of
// state.safetensors with the Python that tools/setup.sh installs:
// each run on a checkpoint directory exported here from a small real store.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include <gtest/gtest.h>

#include "kernels/adam.h"
#include "tests/tools/tools_test_util.h"
#include "tests/vfs/checkpoint_test_util.h"
#include "vfs/checkpoint.h"
#include "vfs/io_buffer.h"

namespace optstate::tools {
namespace {

namespace fs = std::filesystem;
using testing::MakeSmallStore;
using testing::TempDir;
using testing::Tool;

// Writes the latest generation of `store` as a checkpoint directory, through
// the layout the mount serves (what `cp -r` of latest/ gives).
void ExportLatest(vfs::Store* store, const std::string& dir) {
  auto v = store->OpenGeneration(vfs::kLatest);
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  auto l = vfs::CheckpointLayout::Build(v->get());
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  for (const vfs::CheckpointFile& f : (*l)->files()) {
    fs::path p = fs::path(dir) / f.path;
    fs::create_directories(p.parent_path());
    std::string bytes(f.size_bytes, '\0');
    auto n = (*l)->Read(f, 0, bytes.data(), bytes.size());
    ASSERT_TRUE(n.ok()) << n.status().ToString();
    std::ofstream(p, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
}

class RestoreToolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = MakeSmallStore(dir_ / "src");
    ASSERT_NE(store_, nullptr);
    ckpt_ = dir_ / "ckpt";
    ExportLatest(store_.get(), ckpt_);
  }
  TempDir dir_;
  std::unique_ptr<vfs::Store> store_;
  std::string ckpt_;
};

TEST_F(RestoreToolTest, CreatesAStoreAndSaysWhatIsInTheWay) {
  auto ok = Tool("optstate-restore", {ckpt_, dir_ / "restored", "--create", "restored", "-q"});
  ASSERT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_TRUE(fs::exists(dir_ / "restored/IDENTITY"));

  // An existing empty directory: named as such, left as it was.
  fs::create_directory(dir_ / "empty");
  auto empty = Tool("optstate-restore", {ckpt_, dir_ / "empty", "--create", "x", "-q"});
  EXPECT_EQ(empty.exit_code, 1);
  EXPECT_NE(empty.err.find("optstate-restore: error: "), std::string::npos) << empty.err;
  EXPECT_NE(empty.err.find("is an existing empty directory"), std::string::npos) << empty.err;
  EXPECT_EQ(empty.err.find(" already exists"), std::string::npos) << empty.err;
  EXPECT_TRUE(fs::is_empty(dir_ / "empty"));
  // A regular file: named as such, untouched.
  std::ofstream(dir_ / "file") << "precious";
  auto file = Tool("optstate-restore", {ckpt_, dir_ / "file", "--create", "x", "-q"});
  EXPECT_EQ(file.exit_code, 1);
  EXPECT_NE(file.err.find("is a regular file"), std::string::npos) << file.err;
  std::ifstream in(dir_ / "file");
  std::stringstream got;
  got << in.rdbuf();
  EXPECT_EQ(got.str(), "precious");
  // No store there and no --create: the hint says how.
  auto none = Tool("optstate-restore", {ckpt_, dir_ / "nothing", "-q"});
  EXPECT_EQ(none.exit_code, 1);
  EXPECT_NE(none.err.find("--create NAME"), std::string::npos) << none.err;
}

// A store directory where a checkpoint directory belongs is named as one,
// with the ways to get a checkpoint of it (not only "manifest.json: No such
// file"); nothing is made.
TEST_F(RestoreToolTest, AStoreGivenAsTheCheckpointSaysHowToGetOne) {
  for (const std::vector<std::string>& extra : {std::vector<std::string>{"--create", "n"}, {}}) {
    std::vector<std::string> args = {dir_ / "src", dir_ / "new", "-q"};
    args.insert(args.end(), extra.begin(), extra.end());
    auto r = Tool("optstate-restore", args);
    EXPECT_EQ(r.exit_code, 1) << r.err;
    EXPECT_NE(r.err.find(dir_ / "src" + " is a store directory"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("cp -r MNT/<store>/snapshots/<name>"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("optstate.checkpoint.save"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("optstate_checkpoint_export"), std::string::npos) << r.err;
    EXPECT_FALSE(fs::exists(dir_ / "new"));
  }
  // The reshard tool's sources likewise.
  auto l = Tool("optstate-reshard", {"layout", "--ranks", "2", dir_ / "src"});
  EXPECT_EQ(l.exit_code, 1) << l.err;
  EXPECT_NE(l.err.find(" is a store directory"), std::string::npos) << l.err;
}

// Another store's checkpoint into a store that has taken steps: refused
// without --force (the message says how), nothing changed; with --force,
// restored and the replaced head kept as a snapshot that the output names.
TEST_F(RestoreToolTest, AnotherStoresCheckpointNeedsForceAndKeepsTheHead) {
  const std::string other = dir_ / "jobA";
  {
    auto s = MakeSmallStore(other);
    ASSERT_NE(s, nullptr);
    auto t = s->FindTensor("w");
    ASSERT_TRUE(t.ok());
    testing::WriteFloatField(s.get(), t->id, 0, t->numel, [](uint64_t i) { return 2.0f * static_cast<float>(i); });
    vfs::CommitInfo ci;
    ci.step = 5;
    ci.groups.push_back(vfs::GroupInfo{0, 5, {{"lr", 1e-3}}});
    ASSERT_TRUE(s->Commit(ci).ok());
  }
  auto read_main = [](const std::string& path, const std::string& snapshot) {
    auto s = vfs::Store::OpenReadOnly(path, vfs::StoreOptions{});
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    auto v = snapshot.empty() ? (*s)->OpenGeneration(vfs::kLatest) : (*s)->OpenSnapshot(snapshot);
    EXPECT_TRUE(v.ok()) << v.status().ToString();
    vfs::IoBuffer buf((*s)->chunk_size_bytes());
    auto t = (*v)->FindTensor("w");
    EXPECT_TRUE((*v)->ReadChunk({t->id, 0, 0}, buf.data()).ok());
    return std::make_pair((*v)->info().step, buf.as<float>()[7]);
  };
  auto refused = Tool("optstate-restore", {ckpt_, other, "-q"});
  EXPECT_EQ(refused.exit_code, 1) << refused.err;
  EXPECT_NE(refused.err.find("another store"), std::string::npos) << refused.err;
  EXPECT_NE(refused.err.find("--force"), std::string::npos) << refused.err;
  EXPECT_EQ(read_main(other, ""), std::make_pair(uint64_t{5}, 14.0f));

  auto forced = Tool("optstate-restore", {ckpt_, other, "--force"});
  ASSERT_EQ(forced.exit_code, 0) << forced.err;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(forced.out, m, std::regex("as snapshot (pre-restore-[0-9]+-[0-9]+)")))
      << forced.out;
  EXPECT_EQ(read_main(other, ""), std::make_pair(uint64_t{1}, 7.0f));
  EXPECT_EQ(read_main(other, m[1].str()), std::make_pair(uint64_t{5}, 14.0f));
  // --force means nothing to a new store.
  EXPECT_EQ(Tool("optstate-restore", {ckpt_, dir_ / "new", "--create", "n", "--force"}).exit_code, 2);
}

// Malformed command lines: exit 2, the tools' common prefix, and what is
// wrong (an unknown option is named even when the positionals are missing).
TEST_F(RestoreToolTest, BadArgumentsExitTwoAndSayWhatIsWrong) {
  struct Case {
    std::vector<std::string> args;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {{"--frobnicate"}, "unknown option '--frobnicate'"},
      {{ckpt_, dir_ / "x", "--frobnicate"}, "unknown option '--frobnicate'"},
      {{"--quiett", ckpt_, dir_ / "x"}, "did you mean '--quiet'"},
      {{}, "CHECKPOINT_DIR is required"},
      {{ckpt_}, "STORE is required"},
      {{ckpt_, dir_ / "x", "extra"}, "unexpected argument 'extra'"},
      {{ckpt_, dir_ / "x", "--data-dir", "/tmp"}, "--data-dir requires --create"},
      {{ckpt_, dir_ / "x", "--queue-depth", "0"}, "--queue-depth"},
  };
  for (const Case& c : cases) {
    auto r = Tool("optstate-restore", c.args);
    EXPECT_EQ(r.exit_code, 2) << JoinCommand(c.args) << "\n" << r.err;
    EXPECT_EQ(r.err.rfind("optstate-restore: error: ", 0), 0u) << JoinCommand(c.args) << "\n" << r.err;
    EXPECT_NE(r.err.find(c.needle), std::string::npos) << JoinCommand(c.args) << "\n" << r.err;
    if (c.needle.find("unknown option") != std::string::npos) {
      EXPECT_EQ(r.err.find("is required"), std::string::npos) << r.err;
    }
  }
  EXPECT_FALSE(fs::exists(dir_ / "x"));
  // The same conventions in optstate-inspect.
  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{{"--frobnicate"}, {dir_ / "src", "lss"},
                                             {dir_ / "src", "stat", "--frobnicate"},
                                             {dir_ / "src", "ls", "--snapshot", "s1", "--generation", "1"}}) {
    auto r = Tool("optstate-inspect", args);
    EXPECT_EQ(r.exit_code, 2) << JoinCommand(args) << "\n" << r.err;
    EXPECT_EQ(r.err.rfind("optstate-inspect: error: ", 0), 0u) << JoinCommand(args) << "\n" << r.err;
  }
}

// docs/CHECKPOINT.md reads state.safetensors with /usr/bin/python3 and
// Debian's python3-numpy (Debian 12 packages no safetensors module). The
// command is taken from docs/CHECKPOINT.md as it stands and run on a checkpoint.
TEST_F(RestoreToolTest, DocumentedSafetensorsReaderWorks) {
  std::ifstream readme(std::string(OPTSTATE_SOURCE_DIR) + "/docs/CHECKPOINT.md");
  ASSERT_TRUE(readme.good());
  std::string line, script;
  bool in = false;
  while (std::getline(readme, line)) {
    if (!in && line.rfind("/usr/bin/python3 - /tmp/ckpt/state.safetensors <<'EOF'", 0) == 0) {
      in = true;
      script = line + "\n";
      continue;
    }
    if (in) {
      script += line + "\n";
      if (line == "EOF") break;
    }
  }
  ASSERT_FALSE(script.empty()) << "docs/CHECKPOINT.md has no `/usr/bin/python3 - /tmp/ckpt/state.safetensors <<'EOF'` step";
  ASSERT_EQ(script.substr(script.size() - 4), "EOF\n") << script;
  script = std::regex_replace(script, std::regex("/tmp/ckpt"), ckpt_);
  auto r = RunCommand({"/bin/sh", "-c", script});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->exit_code, 0) << "stdout: " << r->out << "\nstderr: " << r->err
                             << "\n(tools/setup.sh installs python3-numpy)";
  // main[i] = i (MakeSmallStore): the first values as numpy prints them, and
  // the generation from the header's metadata.
  EXPECT_NE(r->out.find("w/main F32 (1000,) [0. 1. 2. 3.]"), std::string::npos) << r->out;
  EXPECT_NE(r->out.find("w/exp_avg_sq F32 (1000,) [0. 0. 0. 0.]"), std::string::npos) << r->out;
  EXPECT_NE(r->out.find("'optstate.generation': '" +
                        std::to_string(store_->LatestGeneration().generation) + "'"),
            std::string::npos)
      << r->out;
}


// ---- optstate-restore --moments: converting a checkpoint's moment dtype ----

namespace moments {

constexpr uint64_t kNumel = 700000;  // crosses an f32 chunk (524288) and no bf16 chunk (1048576)

// Values over many magnitudes and both signs, some exact zeros.
float Value(uint32_t field, uint64_t i) {
  if (i % 97 == 0) return 0.0f;
  const double mag = std::pow(10.0, -8.0 + 9.0 * static_cast<double>((i * 2654435761u + field) % 1000) / 1000.0);
  return static_cast<float>((i % 3 == 0 ? -1.0 : 1.0) * mag * (1.0 + 1e-3 * static_cast<double>(i % 1013)));
}

std::unique_ptr<vfs::Store> MakeAdamStore(const std::string& path) {
  std::unique_ptr<vfs::Store> s = testing::CreateTestStore(path);
  if (s == nullptr) return nullptr;
  vfs::TensorSpec spec;
  spec.name = "layer.weight";
  spec.numel = kNumel;
  auto t = s->CreateTensor(spec);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  for (uint32_t f = 0; f < 3; ++f) {
    testing::WriteFloatField(s.get(), t->id, f, kNumel, [f](uint64_t i) { return Value(f, i); });
  }
  vfs::CommitInfo ci;
  ci.step = 42;
  ci.groups.push_back(vfs::GroupInfo{0, 42, {{"lr", 1e-3}, {"adamw", 1.0}}});
  EXPECT_TRUE(s->Commit(ci).ok());
  return s;
}

// A field of the newest generation, decoded to fp32; its dtype in *dtype.
std::vector<float> ReadField(vfs::Store* s, const std::string& field, DType* dtype) {
  std::vector<float> out;
  auto v = s->OpenGeneration(vfs::kLatest);
  EXPECT_TRUE(v.ok()) << v.status().ToString();
  if (!v.ok()) return out;
  auto t = (*v)->FindTensor("layer.weight");
  EXPECT_TRUE(t.ok());
  uint32_t f = 0;
  while (t->fields[f].name != field) ++f;
  *dtype = t->fields[f].dtype;
  const uint32_t es = DTypeSize(*dtype);
  vfs::IoBuffer buf(s->chunk_size_bytes());
  for (uint64_t c = 0; c < (*v)->ChunkCount(*t, f); ++c) {
    EXPECT_TRUE((*v)->ReadChunk({t->id, f, c}, buf.data()).ok());
    const uint64_t n = std::min<uint64_t>(s->chunk_size_bytes() / es, t->numel - out.size());
    for (uint64_t i = 0; i < n; ++i) {
      out.push_back(es == 4 ? buf.as<float>()[i] : kernels::Bf16ToFloat(buf.as<uint16_t>()[i]));
    }
  }
  return out;
}

}  // namespace moments

// f32 -> bf16 -> f32: the moments within 2^-8 relative of the original
// (round to nearest even), bf16 values exact in both directions, main bit
// for bit, step and group step counts kept; the converted store verifies.
TEST(RestoreMomentsTest, F32ToBf16ToF32StaysWithinTheRoundingBound) {
  TempDir dir;
  auto src = moments::MakeAdamStore(dir / "src");
  ASSERT_NE(src, nullptr);
  ExportLatest(src.get(), dir / "ckpt32");
  auto to16 = Tool("optstate-restore", {dir / "ckpt32", dir / "bf16", "--create", "b", "--moments", "bf16", "-q"});
  ASSERT_EQ(to16.exit_code, 0) << to16.err;
  auto b = vfs::Store::Open(dir / "bf16", vfs::StoreOptions{});
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ((*b)->LatestGeneration().step, 42u);
  ASSERT_EQ((*b)->LatestGeneration().groups.size(), 1u);
  EXPECT_EQ((*b)->LatestGeneration().groups[0].step_count, 42u);
  auto rep = (*b)->Verify();
  ASSERT_TRUE(rep.ok()) << rep.status().ToString();
  EXPECT_TRUE(rep->ok()) << (rep->problems.empty() ? "leaked slots" : rep->problems[0]);
  DType d;
  std::vector<std::vector<float>> orig(3), half(3);
  const char* kFields[] = {"main", "exp_avg", "exp_avg_sq"};
  for (int f = 0; f < 3; ++f) {
    orig[f] = moments::ReadField(src.get(), kFields[f], &d);
    half[f] = moments::ReadField(b->get(), kFields[f], &d);
    EXPECT_EQ(d, f == 0 ? DType::kF32 : DType::kBF16) << kFields[f];
    ASSERT_EQ(half[f].size(), moments::kNumel);
  }
  EXPECT_EQ(std::memcmp(half[0].data(), orig[0].data(), moments::kNumel * 4), 0) << "main changed";
  size_t bad = 0;
  for (int f = 1; f < 3; ++f) {
    for (uint64_t i = 0; i < moments::kNumel; ++i) {
      if (std::fabs(static_cast<double>(half[f][i]) - orig[f][i]) > 0x1p-8 * std::fabs(orig[f][i]) && ++bad < 5) {
        ADD_FAILURE() << kFields[f] << "[" << i << "] " << half[f][i] << " vs " << orig[f][i];
      }
    }
  }
  // optstate-inspect show: the bf16 field's dtype and statistics of its decoded values.
  auto show = Tool("optstate-inspect", {dir / "bf16", "show", "layer.weight", "--field", "exp_avg", "--json"});
  ASSERT_EQ(show.exit_code, 0) << show.err;
  auto j = testing::ParseJson(show);
  ASSERT_EQ(j["fields"].size(), 1u) << show.out;
  EXPECT_EQ(j["fields"][0]["dtype"], "bf16");
  EXPECT_EQ(j["fields"][0]["stats"]["count"], moments::kNumel);
  EXPECT_EQ(j["fields"][0]["stats"]["max"].get<double>(), *std::max_element(half[1].begin(), half[1].end()));
  EXPECT_EQ(j["fields"][0]["stats"]["min"].get<double>(), *std::min_element(half[1].begin(), half[1].end()));

  ExportLatest(b->get(), dir / "ckpt16");
  b->reset();
  auto to32 = Tool("optstate-restore", {dir / "ckpt16", dir / "f32", "--create", "f", "--moments", "f32", "-q"});
  ASSERT_EQ(to32.exit_code, 0) << to32.err;
  auto f32 = vfs::Store::Open(dir / "f32", vfs::StoreOptions{});
  ASSERT_TRUE(f32.ok()) << f32.status().ToString();
  for (int f = 0; f < 3; ++f) {
    std::vector<float> back = moments::ReadField(f32->get(), kFields[f], &d);
    EXPECT_EQ(d, DType::kF32);
    ASSERT_EQ(back.size(), moments::kNumel);
    EXPECT_EQ(std::memcmp(back.data(), half[f].data(), moments::kNumel * 4), 0) << kFields[f] << ": bf16 -> f32 is exact";
  }
}

// A q8 moment field of the newest generation decoded as the step decodes it
// (map[code] x the absmax of its block), and that absmax per element.
std::vector<float> ReadQ8Field(vfs::Store* s, const std::string& field, std::vector<float>* absmax) {
  auto v = s->OpenGeneration(vfs::kLatest);
  EXPECT_TRUE(v.ok()) << v.status().ToString();
  if (!v.ok()) return {};
  auto t = (*v)->FindTensor("layer.weight");
  const int f = t->FieldIndexOf(field), sf = t->FieldIndexOf(vfs::Q8ScalesField(field));
  EXPECT_GE(f, 0);
  EXPECT_GE(sf, 0);
  EXPECT_TRUE(IsQ8(t->fields[static_cast<uint32_t>(f)].dtype));
  std::vector<float> out, scales;
  vfs::IoBuffer codes(s->chunk_size_bytes()), sb(s->chunk_size_bytes());
  for (uint64_t c = 0; c < (*v)->ChunkCount(*t, static_cast<uint32_t>(f)); ++c) {
    EXPECT_TRUE((*v)->ReadChunk({t->id, static_cast<uint32_t>(f), c}, codes.data()).ok());
    EXPECT_TRUE((*v)->ReadChunk({t->id, static_cast<uint32_t>(sf), c}, sb.data()).ok());
    const uint64_t n = std::min<uint64_t>(s->chunk_size_bytes(), t->numel - out.size());
    std::vector<float> part(n);
    kernels::Q8Dequantize(field == "exp_avg", codes.as<uint8_t>(), sb.as<float>(), n, part.data());
    out.insert(out.end(), part.begin(), part.end());
    for (uint64_t i = 0; i < n; ++i) scales.push_back(sb.as<float>()[i / 256]);
  }
  *absmax = scales;
  return out;
}

// f32 -> q8 -> f32: each moment within half the gap of the quantization map
// around it times its block's absmax (the quantizer picks the nearest code),
// q8 -> f32 exact (the f32 store holds exactly the decoded values), main bit
// for bit; the converted stores verify.
TEST(RestoreMomentsTest, F32ToQ8ToF32StaysWithinHalfTheMapGap) {
  TempDir dir;
  auto src = moments::MakeAdamStore(dir / "src");
  ASSERT_NE(src, nullptr);
  ExportLatest(src.get(), dir / "ckpt32");
  auto to8 = Tool("optstate-restore", {dir / "ckpt32", dir / "q8", "--create", "q", "--moments", "q8", "-q"});
  ASSERT_EQ(to8.exit_code, 0) << to8.err;
  auto q = vfs::Store::Open(dir / "q8", vfs::StoreOptions{});
  ASSERT_TRUE(q.ok()) << q.status().ToString();
  EXPECT_EQ((*q)->LatestGeneration().step, 42u);
  auto rep = (*q)->Verify();
  ASSERT_TRUE(rep.ok()) << rep.status().ToString();
  EXPECT_TRUE(rep->ok()) << (rep->problems.empty() ? "leaked slots" : rep->problems[0]);
  DType d;
  const char* kFields[] = {"main", "exp_avg", "exp_avg_sq"};
  std::vector<std::vector<float>> orig(3), dec(3);
  for (int f = 0; f < 3; ++f) orig[f] = moments::ReadField(src.get(), kFields[f], &d);
  std::vector<float> main8 = moments::ReadField(q->get(), "main", &d);
  EXPECT_EQ(main8, orig[0]) << "main changed";
  size_t bad = 0;
  for (int f = 1; f < 3; ++f) {
    const bool is_signed = f == 1;
    std::vector<float> map(256);
    for (int c = 0; c < 256; ++c) map[static_cast<size_t>(c)] = kernels::Q8MapValue(is_signed, static_cast<uint8_t>(c));
    std::vector<float> absmax;
    dec[f] = ReadQ8Field(q->get(), kFields[f], &absmax);
    ASSERT_EQ(dec[f].size(), moments::kNumel);
    for (uint64_t i = 0; i < moments::kNumel; ++i) {
      const double a = absmax[i];
      const double r = a > 0 ? orig[f][i] / a : 0.0;
      auto hi = std::lower_bound(map.begin(), map.end(), static_cast<float>(r));
      const double upper = hi == map.end() ? map.back() : *hi;
      const double lower = hi == map.begin() ? map.front() : *(hi - 1);
      // Half the gap around the value, x absmax, plus fp32 rounding of x / absmax and of the product;
      // below the signed map's end (-0.993, for -absmax) the distance to that end.
      const double gap = r < map.front() ? map.front() - r : (upper - lower) / 2;
      const double bound = gap * a + 1e-6 * a;
      if (std::fabs(static_cast<double>(dec[f][i]) - orig[f][i]) > bound && ++bad < 5) {
        ADD_FAILURE() << kFields[f] << "[" << i << "] " << dec[f][i] << " vs " << orig[f][i] << " bound " << bound;
      }
    }
  }

  // optstate-inspect show: the q8 field's dtype and statistics of its decoded values.
  auto show = Tool("optstate-inspect", {dir / "q8", "show", "layer.weight", "--field", "exp_avg", "--json"});
  ASSERT_EQ(show.exit_code, 0) << show.err;
  auto j = testing::ParseJson(show);
  ASSERT_EQ(j["fields"].size(), 1u) << show.out;
  EXPECT_EQ(j["fields"][0]["dtype"], "q8s");
  EXPECT_EQ(j["fields"][0]["stats"]["count"], moments::kNumel);
  EXPECT_EQ(j["fields"][0]["stats"]["max"].get<double>(), *std::max_element(dec[1].begin(), dec[1].end()));
  EXPECT_EQ(j["fields"][0]["stats"]["min"].get<double>(), *std::min_element(dec[1].begin(), dec[1].end()));

  ExportLatest(q->get(), dir / "ckpt8");
  q->reset();
  auto to32 = Tool("optstate-restore", {dir / "ckpt8", dir / "f32", "--create", "f", "--moments", "f32", "-q"});
  ASSERT_EQ(to32.exit_code, 0) << to32.err;
  auto f32 = vfs::Store::Open(dir / "f32", vfs::StoreOptions{});
  ASSERT_TRUE(f32.ok()) << f32.status().ToString();
  for (int f = 0; f < 3; ++f) {
    std::vector<float> back = moments::ReadField(f32->get(), kFields[f], &d);
    EXPECT_EQ(d, DType::kF32);
    const std::vector<float>& want = f == 0 ? orig[0] : dec[f];
    ASSERT_EQ(back.size(), moments::kNumel);
    EXPECT_EQ(std::memcmp(back.data(), want.data(), moments::kNumel * 4), 0) << kFields[f] << ": q8 -> f32 is exact";
  }
  auto t = (*f32)->FindTensor("layer.weight");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->fields.size(), 3u) << "the f32 store has no scales fields";
}

TEST(RestoreMomentsTest, BadInputIsRefusedAndLeavesNoStore) {
  TempDir dir;
  auto src = moments::MakeAdamStore(dir / "src");
  ASSERT_NE(src, nullptr);
  ExportLatest(src.get(), dir / "ckpt");
  // Not a supported dtype, or without --create: a usage error, nothing made.
  auto q = Tool("optstate-restore", {dir / "ckpt", dir / "x", "--create", "x", "--moments", "f8", "-q"});
  EXPECT_EQ(q.exit_code, 2) << q.err;
  auto nc = Tool("optstate-restore", {dir / "ckpt", dir / "src", "--moments", "bf16", "-q"});
  EXPECT_EQ(nc.exit_code, 2) << nc.err;
  EXPECT_FALSE(fs::exists(dir / "x"));
  // A manifest that lies about a moment's dtype (bf16 for an f32 file): refused
  // by both restores, naming the manifest, nothing made.
  {
    std::ifstream in(dir / "ckpt/manifest.json");
    auto m = nlohmann::json::parse(in);
    m["tensors"][0]["fields"][1]["dtype"] = "bf16";
    fs::create_directories(dir / "lying");
    fs::copy(dir / "ckpt", dir / "lying", fs::copy_options::recursive | fs::copy_options::overwrite_existing);
    std::ofstream(dir / "lying/manifest.json") << vfs::testing::SealManifest(m.dump(2));
  }
  for (const std::vector<std::string>& extra : {std::vector<std::string>{}, {"--moments", "bf16"}}) {
    std::vector<std::string> args = {dir / "lying", dir / "z", "--create", "z", "-q"};
    args.insert(args.end(), extra.begin(), extra.end());
    auto lie = Tool("optstate-restore", args);
    EXPECT_EQ(lie.exit_code, 1) << lie.err;
    EXPECT_NE(lie.err.find("manifest.json"), std::string::npos) << lie.err;
    EXPECT_FALSE(fs::exists(dir / "z"));
  }
  // A moment file altered after export: named, and no store is left.
  {
    std::fstream f(dir / "ckpt/tensors/layer.weight/exp_avg_sq", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(2 * vfs::kMiB + 8);
    f.put('\x7f');
  }
  auto bad = Tool("optstate-restore", {dir / "ckpt", dir / "y", "--create", "y", "--moments", "bf16", "-q"});
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.err.find("exp_avg_sq"), std::string::npos) << bad.err;
  EXPECT_NE(bad.err.find("XXH3"), std::string::npos) << bad.err;
  EXPECT_FALSE(fs::exists(dir / "y"));
}

}  // namespace
}  // namespace optstate::tools
