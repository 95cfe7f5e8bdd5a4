// optstate-demo: the main job. Trains a small real model with StreamedAdam
// under a device budget far smaller than its optimizer state, then shows the
// state as files: mounts the store (optstate-mount), snapshots it, copies the
// snapshot with `cp -r`, restores the copy into a fresh store and verifies it
// bit for bit.
//
// The model: a bag-of-tokens regressor. An embedding table (the bulk of the
// parameters, like a recommender's) is averaged over a sample's tokens and fed
// to a 2-layer MLP (d -> hidden -> 1, ReLU). The task: predict a fixed
// nonlinear function of the tokens' hidden scores; tokens are drawn mostly
// from a "hot" subset, so the loss falls within a few dozen steps. Forward and
// backward run on the host in float; gradients are dense and go to
// StreamedAdam (copied to the device with CopyToDevice when a GPU is present).
// Every step streams the whole state (12 B per parameter) from NVMe and back.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <random>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "memmgr/memory_manager.h"
#include "memmgr/streamed_adam.h"
#include "tools/internal/cli.h"
#include "tools/internal/device_buffer.h"
#include "tools/internal/process.h"
#include "tools/internal/store_read.h"
#include "vfs/checkpoint.h"
#include "vfs/store.h"

namespace optstate::tools {
namespace {

namespace fs = std::filesystem;
constexpr const char* kTool = "optstate-demo";
constexpr const char* kStoreName = "demo.rank0000";
constexpr const char* kSnapshot = "demo-final";

struct DemoOptions {
  std::string dir;
  uint64_t params = 25'000'000;
  uint64_t steps = 30;
  std::string budget_text = "24M";
  std::string chunk_text = "2M";
  std::string backend = "auto";
  bool keep = false;
  bool no_mount = false;
  bool json = false;
};

// ---- the model -------------------------------------------------------------

constexpr uint32_t kDim = 32;       // embedding width
constexpr uint32_t kHidden = 64;    // MLP hidden width
constexpr uint32_t kTokens = 4;     // tokens per sample
constexpr uint32_t kBatch = 512;
constexpr uint32_t kHot = 2048;     // tokens drawn 95% of the time

struct Model {
  uint64_t vocab = 0;
  // name -> (offset into params/grads, numel, shape); one flat host array each.
  struct Tensor {
    std::string name;
    uint64_t offset, numel;
    std::vector<uint64_t> shape;  // torch's: (out, in) for a weight
  };
  std::vector<Tensor> tensors;
  std::vector<float> w;      // parameters (model copy; StreamedAdam writes it)
  std::vector<float> g;      // gradients
  float* E() { return w.data() + tensors[0].offset; }
  float* W1() { return w.data() + tensors[1].offset; }
  float* b1() { return w.data() + tensors[2].offset; }
  float* W2() { return w.data() + tensors[3].offset; }
  float* b2() { return w.data() + tensors[4].offset; }
};

Model MakeModel(uint64_t params) {
  Model m;
  uint64_t mlp = kHidden * kDim + kHidden + kHidden + 1;
  m.vocab = std::max<uint64_t>(kHot * 2, (params > mlp ? params - mlp : 0) / kDim);
  uint64_t off = 0;
  auto add = [&](const char* n, std::vector<uint64_t> shape) {
    uint64_t numel = 1;
    for (uint64_t d : shape) numel *= d;
    m.tensors.push_back({n, off, numel, std::move(shape)});
    off += numel;
  };
  add("embed.weight", {m.vocab, kDim});
  add("mlp.fc1.weight", {kHidden, kDim});
  add("mlp.fc1.bias", {kHidden});
  add("mlp.fc2.weight", {1, kHidden});
  add("mlp.fc2.bias", {1});
  m.w.resize(off);
  m.g.assign(off, 0.0f);
  std::mt19937_64 rng(42);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  for (uint64_t i = 0; i < m.vocab * kDim; ++i) m.E()[i] = 0.1f * n01(rng);
  for (uint32_t i = 0; i < kHidden * kDim; ++i) m.W1()[i] = n01(rng) / std::sqrt(float(kDim)) * 2.0f;
  for (uint32_t i = 0; i < kHidden; ++i) m.b1()[i] = 0.01f;
  for (uint32_t i = 0; i < kHidden; ++i) m.W2()[i] = n01(rng) / std::sqrt(float(kHidden));
  m.b2()[0] = 0.0f;
  return m;
}

// The hidden score of a token and the target of a sample.
double Score(uint64_t v) { return std::sin(0.7 * static_cast<double>(v) + 0.3) ; }
double Target(const uint64_t* tok) {
  double s = 0;
  for (uint32_t t = 0; t < kTokens; ++t) s += Score(tok[t]);
  s /= kTokens;
  return std::tanh(2.0 * s);
}

// Forward + backward over a batch; fills m.g (dense; untouched rows zero) and
// returns the mean squared error. `touched` collects the embedding rows used.
double ForwardBackward(Model& m, const std::vector<uint64_t>& tokens, std::vector<uint64_t>* touched) {
  // Clear the previous step's gradient (only rows that were touched).
  for (uint64_t v : *touched) std::memset(m.g.data() + m.tensors[0].offset + v * kDim, 0, kDim * 4);
  touched->clear();
  std::fill(m.g.begin() + static_cast<long>(m.tensors[1].offset), m.g.end(), 0.0f);
  float* gE = m.g.data() + m.tensors[0].offset;
  float* gW1 = m.g.data() + m.tensors[1].offset;
  float* gb1 = m.g.data() + m.tensors[2].offset;
  float* gW2 = m.g.data() + m.tensors[3].offset;
  float* gb2 = m.g.data() + m.tensors[4].offset;
  double loss = 0;
  float h[kDim], a[kHidden], z[kHidden], dh[kDim], dz[kHidden];
  for (uint32_t b = 0; b < kBatch; ++b) {
    const uint64_t* tok = &tokens[b * kTokens];
    for (uint32_t d = 0; d < kDim; ++d) h[d] = 0;
    for (uint32_t t = 0; t < kTokens; ++t) {
      const float* e = m.E() + tok[t] * kDim;
      for (uint32_t d = 0; d < kDim; ++d) h[d] += e[d] / kTokens;
    }
    float y = m.b2()[0];
    for (uint32_t j = 0; j < kHidden; ++j) {
      float s = m.b1()[j];
      for (uint32_t d = 0; d < kDim; ++d) s += m.W1()[j * kDim + d] * h[d];
      z[j] = s;
      a[j] = s > 0 ? s : 0;
      y += m.W2()[j] * a[j];
    }
    double err = y - Target(tok);
    loss += err * err;
    float dy = static_cast<float>(2.0 * err / kBatch);
    gb2[0] += dy;
    for (uint32_t d = 0; d < kDim; ++d) dh[d] = 0;
    for (uint32_t j = 0; j < kHidden; ++j) {
      gW2[j] += dy * a[j];
      dz[j] = z[j] > 0 ? dy * m.W2()[j] : 0;
      gb1[j] += dz[j];
      for (uint32_t d = 0; d < kDim; ++d) {
        gW1[j * kDim + d] += dz[j] * h[d];
        dh[d] += dz[j] * m.W1()[j * kDim + d];
      }
    }
    for (uint32_t t = 0; t < kTokens; ++t) {
      float* ge = gE + tok[t] * kDim;
      for (uint32_t d = 0; d < kDim; ++d) ge[d] += dh[d] / kTokens;
      touched->push_back(tok[t]);
    }
  }
  return loss / kBatch;
}

std::vector<uint64_t> SampleBatch(std::mt19937_64& rng, uint64_t vocab) {
  std::vector<uint64_t> tokens(kBatch * kTokens);
  std::uniform_real_distribution<double> u(0, 1);
  std::uniform_int_distribution<uint64_t> hot(0, kHot - 1), any(0, vocab - 1);
  for (auto& t : tokens) t = u(rng) < 0.95 ? hot(rng) : any(rng);
  return tokens;
}

// ---- helpers -----------------------------------------------------------------

bool FuseUsable(std::string* why) {
  int fd = open("/dev/fuse", O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    *why = fmt::format("/dev/fuse cannot be opened: {}", std::strerror(errno));
    return false;
  }
  close(fd);
  if (getuid() != 0 && !InPath("fusermount3")) {
    *why = "fusermount3 is not installed (apt-get install fuse3)";
    return false;
  }
  return true;
}

// Writes the checkpoint files of a generation (what the mount would show)
// straight from the store: the fallback when FUSE is unusable.
Status ExportDirect(const vfs::GenerationView& view, const std::string& dir) {
  OPTSTATE_ASSIGN_OR_RETURN(auto layout, vfs::CheckpointLayout::Build(&view));
  std::vector<char> buf(8 << 20);
  for (const auto& f : layout->files()) {
    fs::path p = fs::path(dir) / f.path;
    fs::create_directories(p.parent_path());
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    if (!out) return ErrnoStatus(fmt::format("create {}", p.string()), errno);
    for (uint64_t off = 0; off < f.size_bytes;) {
      OPTSTATE_ASSIGN_OR_RETURN(uint64_t n, layout->Read(f, off, buf.data(), buf.size()));
      if (n == 0) return Internal(fmt::format("short export of {}", f.path));
      out.write(buf.data(), static_cast<std::streamsize>(n));
      off += n;
    }
    if (!out.good()) return IoError(fmt::format("write {}", p.string()));
  }
  return Status::Ok();
}


void Say(const std::string& s) {
  std::cout << s << std::flush;
}

int Run(const DemoOptions& o) {
  const double t_start = NowSeconds();
  // Bad option values are a malformed command line (exit 2), as in every tool.
  auto budget = ParseBytes(o.budget_text);
  if (!budget.ok()) return FailUsage(kTool, "--budget: " + budget.status().message());
  auto chunk = ParseBytes(o.chunk_text);
  if (!chunk.ok()) return FailUsage(kTool, "--chunk-size: " + chunk.status().message());
  if (*chunk == 0 || *chunk % vfs::kChunkAlignBytes) {
    return FailUsage(kTool, "--chunk-size must be a multiple of 2 MiB");
  }
  if (o.params < 10'000) return FailUsage(kTool, "--params must be >= 10000");
  if (o.steps < 1) return FailUsage(kTool, "--steps must be >= 1");
  auto parsed_backend = memmgr::ParseBackend(o.backend);
  if (!parsed_backend.ok()) return FailUsage(kTool, "--backend: " + parsed_backend.status().message());
  const memmgr::Backend backend = *parsed_backend;

  std::string dir = o.dir;
  if (dir.empty()) {
    auto d = MakeTempDir("optstate-demo-");
    if (!d.ok()) return FailWith(kTool, d.status());
    dir = *d;
  } else {
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) return FailWith(kTool, ErrnoStatus(fmt::format("create {}", dir), ec.value()));
    if (!fs::is_empty(dir)) {
      return FailWith(kTool, AlreadyExists(fmt::format("--dir {} is not empty; give a new or empty directory", dir)));
    }
  }
  dir = fs::canonical(dir).string();
  const std::string root = dir + "/stores", store_path = root + "/" + kStoreName;
  const std::string mnt = dir + "/mnt", copy = dir + "/checkpoint",
                    restored_path = dir + "/restored/" + kStoreName;
  fs::create_directories(root);
  struct Cleanup {
    std::string dir;
    bool keep;
    ~Cleanup() {
      if (!keep) (void)RemoveTree(dir);
    }
  } cleanup{dir, o.keep};

  Model model = MakeModel(o.params);
  uint64_t numel = model.w.size();
  uint64_t state_bytes = numel * 12;
  Say(fmt::format("optstate-demo: {} parameters ({} embedding rows x {} + a {}-unit MLP), "
                  "optimizer state {} on NVMe, device budget {} ({:.0f}x smaller), chunk {}\n",
                  numel, model.vocab, kDim, kHidden, FormatBytes(state_bytes), FormatBytes(*budget),
                  static_cast<double>(state_bytes) / static_cast<double>(*budget), FormatBytes(*chunk)));

  // 1. Store + manager + optimizer.
  vfs::StoreOptions so;
  so.name = kStoreName;
  so.chunk_size_bytes = *chunk;
  auto store = vfs::Store::Create(store_path, so);
  if (!store.ok()) return FailWith(kTool, store.status());
  memmgr::MemoryManagerOptions mo;
  mo.backend = backend;
  mo.device_budget_bytes = *budget;
  auto mm = memmgr::MemoryManager::Create(store->get(), mo);
  if (!mm.ok()) return FailWith(kTool, mm.status());
  const bool cuda = (*mm)->backend() == memmgr::Backend::kCuda;
  memmgr::StreamedAdamOptions ao;
  ao.cpu_threads = std::max(1u, std::min(4u, std::thread::hardware_concurrency()));
  auto opt = memmgr::StreamedAdam::Create(store->get(), mm->get(), ao);
  if (!opt.ok()) return FailWith(kTool, opt.status());
  memmgr::ParamGroup g;
  g.lr = 1e-2;
  g.weight_decay = 0.0;
  g.adamw = true;
  if (Status s = (*opt)->SetGroup(g); !s.ok()) return FailWith(kTool, s);
  Say(fmt::format("backend: {}{}\nstore: {}\n", memmgr::BackendName((*mm)->backend()),
                  cuda ? " (gradients computed on the host, copied with CopyToDevice)" : " (no GPU: CPU kernels, same pipeline)",
                  store_path));

  // Device copies of weights and gradients (host pointers on the host backend).
  void* d_w = model.w.data();
  void* d_g = model.g.data();
  DeviceBuffer dw, dg;
  if (cuda) {
    auto a = DeviceBuffer::Make(mm->get(), numel * 4);
    auto b = DeviceBuffer::Make(mm->get(), numel * 4);
    if (!a.ok()) return FailWith(kTool, a.status());
    if (!b.ok()) return FailWith(kTool, b.status());
    dw = std::move(*a);
    dg = std::move(*b);
    d_w = dw.get();
    d_g = dg.get();
    if (Status s = (*mm)->CopyToDevice(d_w, model.w.data(), numel * 4); !s.ok()) return FailWith(kTool, s);
  }
  for (const auto& t : model.tensors) {
    memmgr::ShardInfo shape;
    shape.shape = t.shape;  // the store records it (manifest.json, state.safetensors)
    Status s =
        (*opt)->RegisterParam(t.name, t.numel, 0, static_cast<float*>(d_w) + t.offset, DType::kF32, shape);
    if (!s.ok()) return FailWith(kTool, s.WithContext(t.name));
  }

  // 2. Train.
  std::mt19937_64 rng(7);
  std::vector<uint64_t> touched;
  double first_loss = NAN, last_loss = NAN, step_seconds = 0;
  Say(fmt::format("\ntraining {} steps (batch {}, AdamW lr {}):\n", o.steps, kBatch, g.lr));
  for (uint64_t step = 1; step <= o.steps; ++step) {
    std::vector<uint64_t> tokens = SampleBatch(rng, model.vocab);
    double loss = ForwardBackward(model, tokens, &touched);
    if (step == 1) first_loss = loss;
    if (cuda) {
      if (Status s = (*mm)->CopyToDevice(d_g, model.g.data(), numel * 4); !s.ok()) return FailWith(kTool, s);
    }
    std::vector<memmgr::ParamGrad> pg;
    for (const auto& t : model.tensors) {
      memmgr::ParamGrad p;
      p.name = t.name;
      p.d_grad = static_cast<float*>(d_g) + t.offset;
      p.grad_type = DType::kF32;
      p.d_param = static_cast<float*>(d_w) + t.offset;  // updated in the same pass
      p.param_type = DType::kF32;
      pg.push_back(p);
    }
    double t0 = NowSeconds();
    if (Status s = (*opt)->Step(pg); !s.ok()) return FailWith(kTool, s.WithContext(fmt::format("step {}", step)));
    double dt = NowSeconds() - t0;
    step_seconds += dt;
    if (cuda) {
      if (Status s = (*mm)->CopyToHost(model.w.data(), d_w, numel * 4); !s.ok()) return FailWith(kTool, s);
    }
    last_loss = loss;
    if (step == 1 || step == o.steps || step % std::max<uint64_t>(1, o.steps / 10) == 0) {
      Say(fmt::format("  step {:>3}  loss {:.4f}  step() {} ({} each way)\n", step, loss,
                      FormatSeconds(dt), FormatRate(static_cast<double>(state_bytes) / dt)));
    }
  }
  // The last step's commit may still be running (commit_lag_steps 1).
  if (auto d = (*opt)->MakeDurable(); !d.ok()) return FailWith(kTool, d.status());
  auto ms = (*mm)->stats();
  uint64_t streamed = ms.nvme_read_bytes + ms.nvme_write_bytes;
  Say(fmt::format("loss {:.4f} -> {:.4f}; peak device memory {} of a {} budget\n", first_loss, last_loss,
                  FormatBytes(ms.peak_resident_bytes), FormatBytes(ms.budget_bytes)));

  // 3. Snapshot.
  auto snap = (*store)->CreateSnapshot(kSnapshot);
  if (!snap.ok()) return FailWith(kTool, snap.status());
  Say(fmt::format("\nsnapshot '{}' -> generation {} (step {})\n", kSnapshot, snap->generation,
                  (*store)->LatestGeneration().step));

  // 4. Mount and cp -r (or a direct export when FUSE is unusable).
  std::string why;
  bool mounted = false;
  std::string how;
  double copy_seconds = 0;
  Child daemon;
  if (!o.no_mount && FuseUsable(&why)) {
    auto bin = FindTool("optstate-mount");
    if (!bin.ok()) {
      why = bin.status().message();
    } else {
      fs::create_directories(mnt);
      auto c = Child::Start({*bin, "-f", root, mnt}, dir + "/optstate-mount.log");
      if (!c.ok()) {
        why = c.status().ToString();
      } else {
        daemon = std::move(*c);
        for (int i = 0; i < 200 && !(mounted = IsFuseMounted(mnt)); ++i) {
          int code;
          if (daemon.Exited(&code)) {
            why = fmt::format("optstate-mount exited with {} (log: {})", code, daemon.log_path());
            break;
          }
          std::this_thread::sleep_for(std::chrono::milliseconds(25));
        }
        if (!mounted && why.empty()) why = "optstate-mount did not mount within 5 s";
      }
    }
  } else if (o.no_mount) {
    why = "--no-mount";
  }
  std::string src = mnt + "/" + kStoreName + "/snapshots/" + kSnapshot;
  if (mounted) {
    Say(fmt::format("mounted {} at {} (optstate-mount, pid {})\n", root, mnt, daemon.pid()));
    Say(fmt::format("$ ls {}\n", src));
    std::error_code ec;
    std::string listing;
    for (const auto& e : fs::directory_iterator(src, ec)) listing += "  " + e.path().filename().string();
    Say(listing + "\n");
    Say(fmt::format("$ cp -r {} {}\n", src, copy));
    double t0 = NowSeconds();
    auto r = RunCommand({"cp", "-r", src, copy});
    copy_seconds = NowSeconds() - t0;
    if (!r.ok() || r->exit_code != 0) {
      daemon.Stop();
      return FailWith(kTool, IoError(fmt::format("cp -r {} {} failed: {}", src, copy,
                                                 r.ok() ? r->err : r.status().ToString())));
    }
    auto u = RunCommand({"fusermount3", "-u", mnt});
    int code = -1;
    // After the unmount the daemon leaves its loop on its own; SIGTERM only if it lingers.
    for (int i = 0; i < 200 && !daemon.Exited(&code); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    if (daemon.running()) code = daemon.Stop();
    Say(fmt::format("unmounted (fusermount3 -u: {}; daemon exit {})\n",
                    u.ok() && u->exit_code == 0 ? "ok" : "failed", code));
    how = "cp -r from the FUSE mount";
  } else {
    Say(fmt::format("FUSE is unusable here ({}); exporting the snapshot directly from the store instead\n", why));
    auto view = (*store)->OpenSnapshot(kSnapshot);
    if (!view.ok()) return FailWith(kTool, view.status());
    double t0 = NowSeconds();
    if (Status s = ExportDirect(**view, copy); !s.ok()) return FailWith(kTool, s);
    copy_seconds = NowSeconds() - t0;
    how = "direct export (no FUSE)";
  }
  auto copied = TreeBytes(copy);
  uint64_t copied_bytes = copied.ok() ? *copied : 0;
  Say(fmt::format("copied {} in {} ({})\n", FormatBytes(copied_bytes), FormatSeconds(copy_seconds),
                  FormatRate(static_cast<double>(copied_bytes) / copy_seconds)));

  // 5. Restore into a fresh store and verify bit for bit.
  Say(fmt::format("\nrestoring {} into a fresh store {}\n", copy, restored_path));
  fs::create_directories(fs::path(restored_path).parent_path());
  vfs::StoreOptions ro;
  ro.name = kStoreName;
  auto restored = vfs::CreateStoreFromCheckpoint(copy, restored_path, ro);
  if (!restored.ok()) return FailWith(kTool, restored.status().WithContext("restore"));
  auto va = (*store)->OpenSnapshot(kSnapshot);
  if (!va.ok()) return FailWith(kTool, va.status());
  auto vb = (*restored)->OpenGeneration(vfs::kLatest);
  if (!vb.ok()) return FailWith(kTool, vb.status());
  auto diffs = CompareGenerations(**va, **vb);
  if (!diffs.ok()) return FailWith(kTool, diffs.status());
  auto rep = (*restored)->Verify();
  if (!rep.ok()) return FailWith(kTool, rep.status());
  bool identical = diffs->empty();
  for (const auto& d : *diffs) Say("  DIFFERENCE: " + d + "\n");
  Say(fmt::format("verify: {} tensors, every field compared byte by byte: {}; restored store Verify(): {}\n",
                  (*va)->tensors().size(), identical ? "identical" : "DIFFERENT",
                  rep->ok() ? "clean" : "PROBLEMS"));

  // 6. Summary.
  double wall = NowSeconds() - t_start;
  Say(fmt::format(
      "\nsummary\n"
      "  model                {} params; loss {:.4f} -> {:.4f} over {} steps\n"
      "  optimizer state      {} (fp32 main + exp_avg + exp_avg_sq) on NVMe\n"
      "  device budget        {}; peak device memory {}\n"
      "  streamed             {} read from the store ({} more served by the RAM tier) + {} written in {} of "
      "step() ({} per step, {})\n"
      "  checkpoint           {}: {}\n"
      "  restore              bit-for-bit {}\n"
      "  wall time            {}\n",
      numel, first_loss, last_loss, o.steps, FormatBytes(state_bytes), FormatBytes(ms.budget_bytes),
      FormatBytes(ms.peak_resident_bytes), FormatBytes(ms.nvme_read_bytes), FormatBytes(ms.cache_hit_bytes),
      FormatBytes(ms.nvme_write_bytes), FormatSeconds(step_seconds),
      FormatSeconds(step_seconds / static_cast<double>(o.steps)),
      FormatRate(static_cast<double>(streamed) / step_seconds), how, FormatBytes(copied_bytes),
      identical && rep->ok() ? "OK" : "FAILED", FormatSeconds(wall)));
  if (o.keep) {
    Say(fmt::format("  files (kept)         store {}\n                       checkpoint copy {}\n"
                    "                       restored store {}\n"
                    "  try: optstate-inspect {} ls; optstate-mount {} {}\n",
                    store_path, copy, restored_path, store_path, root, mnt));
  } else {
    Say(fmt::format("  files                {} (removed; --keep keeps them)\n", dir));
  }
  if (o.json) {
    nlohmann::json j = {{"params", numel}, {"state_bytes", state_bytes}, {"budget_bytes", ms.budget_bytes},
                        {"peak_resident_bytes", ms.peak_resident_bytes}, {"first_loss", first_loss},
                        {"last_loss", last_loss}, {"steps", o.steps}, {"nvme_read_bytes", ms.nvme_read_bytes},
                        {"nvme_write_bytes", ms.nvme_write_bytes}, {"cache_hit_bytes", ms.cache_hit_bytes},
                        {"step_seconds", step_seconds},
                        {"mounted", mounted}, {"copy", how}, {"copied_bytes", copied_bytes},
                        {"identical", identical}, {"verify_ok", rep->ok()}, {"wall_seconds", wall},
                        {"backend", memmgr::BackendName((*mm)->backend())}, {"dir", dir}};
    std::cerr << j.dump() << "\n";
  }
  return identical && rep->ok() && ms.peak_resident_bytes <= ms.budget_bytes ? 0 : 1;
}

}  // namespace
}  // namespace optstate::tools

int main(int argc, char** argv) {
  // The library's info lines would bury the demo's own output.
  setenv("OPTSTATE_LOG_LEVEL", "warn", /*overwrite=*/0);
  optstate::tools::DemoOptions o;
  CLI::App app{"optstate-demo: train a small model with StreamedAdam under a tiny device budget, "
               "mount its state, cp -r a snapshot, restore it, verify it bit for bit"};
  app.name("optstate-demo");
  app.add_option("--dir", o.dir, "working directory (default: a new dir in /tmp)");
  app.add_option("--params", o.params, "model parameters (default 25000000: 300 MB of state)");
  app.add_option("--steps", o.steps, "training steps (default 30)");
  app.add_option("--budget", o.budget_text, "device budget (default 24M)");
  app.add_option("--chunk-size", o.chunk_text, "store chunk size (default 2M)");
  app.add_option("--backend", o.backend, "auto, host or cuda (default auto)");
  app.add_flag("--keep", o.keep, "keep the store, the copy and the restored store");
  app.add_flag("--no-mount", o.no_mount, "skip FUSE; export the snapshot directly");
  app.add_flag("--json", o.json, "also print a JSON summary line on stderr");
  if (std::optional<int> code = optstate::tools::ParseCommandLine(app, argc, argv, "optstate-demo")) {
    return *code;
  }
  return optstate::tools::Run(o);
}
