// Reader leases (Core, vfs/internal/store_core.h): leases/.lock and the lease
// files of live readers, which keep their generations from GC.
#include "vfs/internal/store_core.h"

#include <signal.h>

#include <cstdio>

namespace optstate::vfs::internal {

Result<FlockGuard> Core::LockLeases(int op) {
  if (!lease_lock_file_) {
    return FailedPrecondition("store " + path_ + ": leases/.lock is not open");
  }
  return FlockGuard::Take(lease_lock_file_.get(), op);
}

Result<std::vector<uint64_t>> Core::LeasedGenerations() {
  std::vector<uint64_t> gens;
  OPTSTATE_ASSIGN_OR_RETURN(auto names, fs_->ListDir(leases_dir_));
  for (const auto& name : names) {
    if (name.empty() || name[0] == '.') continue;
    unsigned long long pid = 0, gen = 0, nonce = 0;
    int used = 0;
    if (sscanf(name.c_str(), "%llu.%llu.%llu%n", &pid, &gen, &nonce, &used) != 3) continue;
    const std::string_view rest = std::string_view(name).substr(static_cast<size_t>(used));
    const std::string file = JoinPath(leases_dir_, name);
    if (rest == kLeaseSuffix) {
      if (LeaseFileHeld(file)) gens.push_back(gen);
      continue;
    }
    if (!rest.empty()) continue;
    if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      (void)fs_->Remove(file);
      continue;
    }
    gens.push_back(gen);
  }
  return gens;
}

bool Core::LeaseFileHeld(const std::string& file) {
  OpenOptions oo;
  oo.read_only = true;
  auto f = fs_->Open(file, oo);
  if (!f.ok()) {
    if (f.status().IsNotFound()) return false;  // its reader released it just now
    OPTSTATE_LOG_WARN("store {}: cannot check reader lease {} ({}); keeping its generation", path_, file,
                      f.status().ToString());
    return true;
  }
  for (;;) {
    if (::flock((*f)->fd(), LOCK_EX | LOCK_NB) == 0) break;
    if (errno == EINTR) continue;
    if (errno != EWOULDBLOCK) {
      OPTSTATE_LOG_WARN("store {}: flock of reader lease {}: {}; keeping its generation", path_, file,
                        std::strerror(errno));
    }
    return true;
  }
  OPTSTATE_LOG_INFO("store {}: removing the lease {} of a reader that has ended", path_, file);
  (void)fs_->Remove(file);
  return false;
}

}  // namespace optstate::vfs::internal
