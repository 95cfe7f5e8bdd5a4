// Child process of the store crash tests.
//
//   store_crash_child run  STORE MAX_GENERATIONS   commit the deterministic workload
//       (tests/vfs/store_crash_workload.h), printing "ACK <gen>" after each
//       commit returns; takes snapshots g<gen> every 3rd generation, releases old
//       ones, runs GC every 5th. Killed by the parent or by OPTSTATE_CRASH_AT.
//   store_crash_child open STORE    try to open STORE; print the status; exit 0 if
//       opened, 3 if busy, 4 on other errors.
//   store_crash_child hold STORE    open STORE, print "READY", sleep until killed.
//   store_crash_child restore STORE CKPT [DATA_DIR]   CreateStoreFromCheckpoint
//       (optstate-restore --create) of CKPT at STORE; prints "DONE" (exit 0)
//       or the error (exit 4). Killed by OPTSTATE_CRASH_AT.
//   store_crash_child revert STORE SNAPSHOT   Store::RevertToSnapshot (store of
//       TestOptions()); prints "DONE <generation> <kept snapshot>" (exit 0) or
//       the error (exit 4). Killed by OPTSTATE_CRASH_AT.
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

#include "tests/vfs/store_crash_workload.h"
#include "vfs/checkpoint.h"
#include "vfs/store.h"

using namespace optstate;
using namespace optstate::vfs;
using namespace optstate::vfs::store_testing;

namespace {

void Say(const std::string& s) {
  std::string line = s + "\n";
  (void)!::write(1, line.data(), line.size());
}

[[noreturn]] void Die(const std::string& what, const Status& s) {
  Say("ERROR " + what + ": " + s.ToString());
  std::_Exit(2);
}

int Run(const std::string& path, uint64_t max_gens) {
  const StoreOptions opts = WorkloadOptions();
  std::unique_ptr<Store> store;
  if (::access(path.c_str(), F_OK) != 0) {
    auto c = Store::Create(path, opts);
    if (!c.ok()) Die("create", c.status());
    store = std::move(*c);
  } else {
    auto o = Store::Open(path, opts);
    if (!o.ok()) Die("open", o.status());
    store = std::move(*o);
  }
  const auto& specs = WorkloadTensors();
  std::vector<TensorInfo> tensors;
  for (const auto& w : specs) {
    auto t = store->FindTensor(w.name);
    if (!t.ok()) {
      TensorSpec spec;
      spec.name = w.name;
      spec.numel = w.numel;
      t = store->CreateTensor(spec);
      if (!t.ok()) Die("create tensor", t.status());
    }
    tensors.push_back(*t);
  }
  Buf buf(kTestChunk);
  std::vector<std::unique_ptr<Buf>> bufs;
  const uint64_t first = store->LatestGeneration().generation + 1;
  for (uint64_t g = first; g < first + max_gens; ++g) {
    const bool async = g % 2 == 0;
    std::unique_ptr<ChunkIo> io;
    if (async) {
      auto r = store->NewChunkIo(ChunkIoOptions{});
      if (!r.ok()) Die("chunk io", r.status());
      io = std::move(*r);
    }
    size_t used = 0;
    for (uint32_t ti = 0; ti < tensors.size(); ++ti) {
      for (uint32_t f = 0; f < 3; ++f) {
        for (uint64_t c = 0; c < store->ChunkCount(tensors[ti], f); ++c) {
          if (!Writes(g, ti, f, c)) continue;
          if (async) {
            if (used == bufs.size()) bufs.push_back(std::make_unique<Buf>(kTestChunk));
            FillPattern(bufs[used]->data(), kTestChunk, WorkloadSeed(g, ti, f, c));
            Status s = io->SubmitWrite(ChunkRef{tensors[ti].id, f, c}, bufs[used]->data(), used);
            if (!s.ok()) Die("submit write", s);
            ++used;
          } else {
            FillPattern(buf.data(), kTestChunk, WorkloadSeed(g, ti, f, c));
            Status s = store->WriteChunk(ChunkRef{tensors[ti].id, f, c}, buf.data());
            if (!s.ok()) Die("write", s);
          }
        }
      }
    }
    if (async) {
      std::vector<ChunkCompletion> done;
      while (io->in_flight() > 0) {
        Status s = io->Reap(&done, 1);
        if (!s.ok()) Die("reap", s);
      }
      for (const auto& d : done) {
        if (!d.status.ok()) Die("write completion", d.status);
      }
    }
    CommitInfo ci;
    ci.step = StepOf(g);
    ci.groups = {GroupInfo{0, g, {{"lr", 1.0 / static_cast<double>(g)}}}};
    auto r = store->Commit(ci);
    if (!r.ok()) Die("commit", r.status());
    if (*r != g) Die("commit", Internal("committed generation " + std::to_string(*r) + ", expected " + std::to_string(g)));
    Say("ACK " + std::to_string(g));
    if (g % 3 == 0) {
      auto s = store->CreateSnapshot("g" + std::to_string(g));
      if (!s.ok() && s.status().code() != StatusCode::kAlreadyExists) Die("snapshot", s.status());
      for (const auto& snap : store->ListSnapshots()) {
        if (snap.generation + 6 <= g) {
          Status rs = store->ReleaseSnapshot(snap.name);
          if (!rs.ok()) Die("release snapshot", rs);
        }
      }
    }
    if (g % 5 == 0) {
      Status s = store->CollectGarbage();
      if (!s.ok()) Die("gc", s);
    }
  }
  Say("DONE");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s run STORE MAX_GENS | open STORE | hold STORE\n", argv[0]);
    return 1;
  }
  const std::string mode = argv[1], path = argv[2];
  if (mode == "restore" && argc > 3) {
    StoreOptions o;
    o.preallocate_step_bytes = 16ull << 20;
    if (argc > 4) o.data_dirs = {argv[4]};
    auto s = CreateStoreFromCheckpoint(argv[3], path, o);
    if (!s.ok()) {
      Say("STATUS " + s.status().ToString());
      return 4;
    }
    Say("DONE");
    return 0;
  }
  if (mode == "revert" && argc > 3) {
    auto s = Store::Open(path, TestOptions());
    if (!s.ok()) {
      Say("STATUS " + s.status().ToString());
      return 4;
    }
    auto r = (*s)->RevertToSnapshot(argv[3]);
    if (!r.ok()) {
      Say("STATUS " + r.status().ToString());
      return 4;
    }
    Say("DONE " + std::to_string(r->generation) + " " + r->kept_snapshot);
    return 0;
  }
  if (mode == "run") return Run(path, argc > 3 ? std::stoull(argv[3]) : 1000000);
  if (mode == "open" || mode == "hold") {
    auto s = Store::Open(path, WorkloadOptions());
    if (!s.ok()) {
      Say("STATUS " + s.status().ToString());
      return s.status().code() == StatusCode::kBusy ? 3 : 4;
    }
    Say(mode == "hold" ? "READY" : "STATUS OK");
    if (mode == "hold") {
      for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
    }
    return 0;
  }
  return 1;
}
