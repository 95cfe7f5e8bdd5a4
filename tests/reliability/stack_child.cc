// Child process of the full-stack crash loop (stack_crash_test.cc).
//
//   reliability_stack_child STORE MAX_STEPS
//     Creates STORE if absent (else reopens it), then runs StreamedAdam (host
//     backend, 6-chunk budget, 2-slice read-ahead) over the workload of
//     stack_workload.h: registers param.<k> (a no-op on reopen), and steps
//     t = step_count+1, ... MAX_STEPS times, printing "ACK <t>" after each Step
//     returned OK. The optimizer runs with the default commit_lag_steps (1):
//     step t's commit may still be in flight after its ACK, while step t-1's
//     is complete (Step t waited for it); the destructor at a normal exit
//     waits for the last one. Every 3rd step it snapshots
//     ("s<t>") and releases snapshots 6 steps old, so snapshot create/release
//     and GC (after every commit and release) are inside the loop. Killed by
//     the parent at random instants or by OPTSTATE_CRASH_AT.
//   reliability_stack_child limits STORE NOFILE MEMLOCK_BYTES DROP_IPC_LOCK
//     Sets RLIMIT_NOFILE / RLIMIT_MEMLOCK (0 = unchanged), optionally drops
//     CAP_IPC_LOCK (root ignores RLIMIT_MEMLOCK otherwise), then runs 3 steps.
//     Prints "PHASE <p>" before each phase; on an error prints "FAIL <p>: <msg>"
//     and exits 10 when it happened at start (open/create, memory manager,
//     optimizer, registration) or 20 during a step.
#include <linux/capability.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "memmgr/memory_manager.h"
#include "memmgr/streamed_adam.h"
#include "tests/reliability/stack_workload.h"
#include "vfs/store.h"

using namespace optstate;
using namespace optstate::reliability;

namespace {

void Say(const std::string& s) {
  std::string line = s + "\n";
  (void)!::write(1, line.data(), line.size());
}

[[noreturn]] void Die(const std::string& what, const Status& s) {
  Say("ERROR " + what + ": " + s.ToString());
  std::_Exit(2);
}

std::string g_phase = "start";
bool g_limits_mode = false;

[[noreturn]] void DieAt(const std::string& what, const Status& s) {
  if (!g_limits_mode) Die(what, s);
  Say("FAIL " + g_phase + ": " + what + ": " + s.ToString());
  std::_Exit(g_phase == "step" ? 20 : 10);
}

void Phase(const std::string& p) {
  g_phase = p;
  if (g_limits_mode) Say("PHASE " + p);
}

void SetLimit(int resource, uint64_t v) {
  if (v == 0) return;
  rlimit rl{v, v};
  if (::setrlimit(resource, &rl) != 0) Say(std::string("setrlimit: ") + std::strerror(errno));
}

void DropIpcLock() {
  __user_cap_header_struct h{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct d[2]{};
  if (::syscall(SYS_capget, &h, d) != 0) return;
  d[CAP_IPC_LOCK / 32].effective &= ~(1u << (CAP_IPC_LOCK % 32));
  d[CAP_IPC_LOCK / 32].permitted &= ~(1u << (CAP_IPC_LOCK % 32));
  if (::syscall(SYS_capset, &h, d) != 0) Say(std::string("capset: ") + std::strerror(errno));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 7 && std::string(argv[1]) == "limits") {
    g_limits_mode = true;
    SetLimit(RLIMIT_NOFILE, std::strtoull(argv[3], nullptr, 10));
    SetLimit(RLIMIT_MEMLOCK, std::strtoull(argv[4], nullptr, 10));
    if (std::string(argv[5]) == "1") DropIpcLock();
    argv += 1;
    argc = 3;
    argv[2] = argv[5];
  } else if (argc != 3) {
    std::fprintf(stderr, "usage: reliability_stack_child STORE MAX_STEPS | limits STORE NOFILE MEMLOCK DROP STEPS\n");
    return 64;
  }
  const std::string path = argv[1];
  const uint64_t max_steps = std::strtoull(argv[2], nullptr, 10);
  Phase("open");
  vfs::StoreOptions so;
  so.chunk_size_bytes = kStackChunk;
  so.preallocate_step_bytes = 8 * kStackChunk;
  so.retained_generations = 2;
  std::unique_ptr<vfs::Store> store;
  if (::access(path.c_str(), F_OK) != 0) {
    auto c = vfs::Store::Create(path, so);
    if (!c.ok()) DieAt("create", c.status());
    store = std::move(*c);
  } else {
    auto o = vfs::Store::Open(path, so);
    if (!o.ok()) DieAt("open", o.status());
    store = std::move(*o);
  }
  memmgr::MemoryManagerOptions mo;
  mo.backend = memmgr::Backend::kHost;
  mo.device_budget_bytes = 6 * kStackChunk;
  mo.read_ahead_chunks = 2;
  Phase("memory_manager");
  auto mm = memmgr::MemoryManager::Create(store.get(), mo);
  if (!mm.ok()) DieAt("memory manager", mm.status());
  Phase("optimizer");
  memmgr::StreamedAdamOptions ao;  // commit_lag_steps: the default, 1 (pipelined commits)
  auto sa = memmgr::StreamedAdam::Create(store.get(), mm->get(), ao);
  if (!sa.ok()) DieAt("streamed adam", sa.status());
  memmgr::ParamGroup g;
  g.id = 0;
  g.lr = kLr;
  g.beta1 = kBeta1;
  g.beta2 = kBeta2;
  g.eps = kEps;
  g.weight_decay = kWeightDecay;
  g.adamw = true;
  Status st = (*sa)->SetGroup(g);
  if (!st.ok()) DieAt("set group", st);
  Phase("register");
  const auto& ps = StackParams();
  std::vector<std::vector<float>> grads(ps.size());
  for (uint32_t k = 0; k < ps.size(); ++k) {
    std::vector<float> w0(ps[k].numel);
    for (uint64_t i = 0; i < ps[k].numel; ++i) w0[i] = InitialWeight(k, i);
    st = (*sa)->RegisterParam(ps[k].name, ps[k].numel, 0, w0.data(), DType::kF32);
    if (!st.ok()) DieAt("register " + ps[k].name, st);
    grads[k].resize(ps[k].numel);
  }
  Say("READY " + std::to_string((*sa)->step_count(0)));
  Phase("step");
  for (uint64_t n = 0; n < max_steps; ++n) {
    const uint64_t t = (*sa)->step_count(0) + 1;
    std::vector<memmgr::ParamGrad> list;
    for (uint32_t k = 0; k < ps.size(); ++k) {
      for (uint64_t i = 0; i < ps[k].numel; ++i) grads[k][i] = Gradient(t, k, i);
      memmgr::ParamGrad pg;
      pg.name = ps[k].name;
      pg.d_grad = grads[k].data();
      pg.grad_type = DType::kF32;
      list.push_back(pg);
    }
    st = (*sa)->Step(list);
    if (!st.ok()) DieAt("step " + std::to_string(t), st);
    if ((*sa)->step_count(0) != t) Die("step", Internal("step count " + std::to_string((*sa)->step_count(0))));
    Say("ACK " + std::to_string(t));
    if (t % 3 == 0) {
      auto s = store->CreateSnapshot("s" + std::to_string(t));
      if (!s.ok() && s.status().code() != StatusCode::kAlreadyExists) Die("snapshot", s.status());
      for (const auto& snap : store->ListSnapshots()) {
        if (snap.name.size() > 1 && std::strtoull(snap.name.c_str() + 1, nullptr, 10) + 6 <= t) {
          Status rs = store->ReleaseSnapshot(snap.name);
          if (!rs.ok()) Die("release snapshot", rs);
        }
      }
    }
  }
  Say("DONE");
  return 0;
}
