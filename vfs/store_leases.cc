// Reader leases (Core, vfs/internal/store_core.h): leases/.lock and the lease
// files of live readers, which keep their generations from GC.
#include "vfs/internal/store_core.h"
#include "vfs/internal/store_open.h"
#include "vfs/internal/generation_view.h"

#include <signal.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "base/log.h"

namespace optstate::vfs::internal {
namespace {

// The mount a path resolves through (/proc/self/mountinfo), with whether the
// filesystem under it (its superblock, not only this mount) is read-only.
struct MountOf {
  std::string mount_point;
  bool filesystem_read_only = false;
};

// mountinfo escapes space, tab, newline and backslash as \ooo (octal).
std::string UnescapeMountField(const std::string& f) {
  std::string out;
  for (size_t i = 0; i < f.size(); ++i) {
    if (f[i] == '\\' && i + 3 < f.size()) {
      out.push_back(static_cast<char>(std::strtol(f.substr(i + 1, 3).c_str(), nullptr, 8)));
      i += 3;
    } else {
      out.push_back(f[i]);
    }
  }
  return out;
}

bool HasOption(const std::string& options, const std::string& word) {
  std::stringstream ss(options);
  std::string o;
  while (std::getline(ss, o, ',')) {
    if (o == word) return true;
  }
  return false;
}

// The last-mounted mount whose mount point is the longest prefix of the real
// path of `dir`; nullopt when the path or /proc/self/mountinfo cannot be read.
std::optional<MountOf> FindMountOf(const std::string& dir) {
  std::error_code ec;
  const std::string path = std::filesystem::canonical(dir, ec).string();
  if (ec) return std::nullopt;
  std::ifstream in("/proc/self/mountinfo");
  if (!in) return std::nullopt;
  std::optional<MountOf> best;
  std::string line;
  while (std::getline(in, line)) {
    // id parent major:minor root mount_point mount_options [optional...] - fstype source super_options
    std::istringstream ls(line);
    std::vector<std::string> f;
    for (std::string w; ls >> w;) f.push_back(w);
    size_t dash = 6;
    while (dash < f.size() && f[dash] != "-") ++dash;
    if (f.size() < 6 || dash + 3 >= f.size()) continue;
    const std::string mp = UnescapeMountField(f[4]);
    const bool under = mp == "/" || path == mp || (path.size() > mp.size() && path.compare(0, mp.size(), mp) == 0 &&
                                                   path[mp.size()] == '/');
    if (!under || (best && mp.size() < best->mount_point.size())) continue;
    best = MountOf{mp, HasOption(f[dash + 3], "ro")};
  }
  return best;
}

}  // namespace

Result<FlockGuard> Core::LockLeases(int op) {
  // On a read-only filesystem no one writes leases or RETAINED: nothing to hold off.
  if (filesystem_read_only_) return FlockGuard();
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

Status OpenLeaseLock(Core* c) {
  OPTSTATE_RETURN_IF_ERROR(c->fs_->CreateDir(c->leases_dir_));
  OpenOptions oo;
  oo.create = true;
  auto f = c->fs_->Open(JoinPath(c->leases_dir_, ".lock"), oo);
  if (!f.ok()) return f.status().WithContext("store " + c->path_ + ": leases/.lock");
  c->lease_lock_file_ = std::move(*f);
  return Status();
}

Status OpenReaderLeaseLock(Core* c) {
  OpenOptions oo;
  oo.create = true;  // a store created before leases/ existed has none yet
  auto f = c->fs_->Open(JoinPath(c->leases_dir_, ".lock"), oo);
  if (f.ok()) {
    c->lease_lock_file_ = std::move(*f);
    return Status();
  }
  if (f.status().err() != EROFS) return f.status().WithContext("store " + c->path_ + ": leases/.lock");
  OPTSTATE_RETURN_IF_ERROR(CheckReaderFilesystem(c->path_));
  OPTSTATE_LOG_DEBUG("store {}: on a read-only filesystem: reading without leases", c->path_);
  c->filesystem_read_only_ = true;
  return Status();
}

Result<std::unique_ptr<GenerationView>> OpenGenerationView(const std::shared_ptr<Core>& core, uint64_t generation,
                                                           const std::string& snapshot) {
  auto resolve = [&](uint64_t* g) REQUIRES(core->mu_) -> Status {
    if (!snapshot.empty()) {
      auto s = core->snapshots_.find(snapshot);
      if (s == core->snapshots_.end()) return core->SnapshotNotFound(snapshot);
      *g = s->second.generation;
    } else {
      *g = generation == kLatest ? core->latest_.generation : generation;
    }
    if (!core->generations_.count(*g)) {
      std::string have;
      for (const auto& [x, i] : core->generations_) have += (have.empty() ? "" : ", ") + std::to_string(x);
      return NotFound("store " + core->path_ + ": generation " + std::to_string(*g) +
                      " is not retained (retained: " + have + ")");
    }
    return Status();
  };
  if (!core->read_only_) {
    MutexLock l(&core->mu_);
    uint64_t g;
    OPTSTATE_RETURN_IF_ERROR(resolve(&g));
    auto v = BuildView(core, g);
    core->AddViewRef(g);
    v->in_process_ref = true;
    return NewGenerationView(std::move(v));
  }
  if (core->filesystem_read_only_) {
    // Nothing can write the store (vfs/store.h): g stays as the index shows it.
    MutexLock l(&core->mu_);
    uint64_t g;
    OPTSTATE_RETURN_IF_ERROR(resolve(&g));
    OPTSTATE_RETURN_IF_ERROR(core->CheckIndexOf(g));
    return NewGenerationView(BuildView(core, g));
  }
  // Read-only: a lease file, then (under the same shared flock) RETAINED says
  // whether the writer still keeps g; g's entries come from this process's
  // index, checked against g's digest.
  static std::atomic<uint64_t> nonce{0};
  std::mt19937_64 rng(std::random_device{}());
  bool reopen = false;
  Status why = Busy("the writer collected each generation before a lease on it was taken");
  for (int attempt = 0; attempt < 20; ++attempt) {
    OPTSTATE_RETURN_IF_ERROR(core->CatchUpChecked(reopen));
    reopen = false;
    uint64_t g;
    {
      MutexLock l(&core->mu_);
      OPTSTATE_RETURN_IF_ERROR(resolve(&g));
    }
    const std::string lease =
        JoinPath(core->leases_dir_, std::to_string(getpid()) + "." + std::to_string(g) + "." +
                                     std::to_string((rng() & 0xffffffffull) * 1000 + nonce++ % 1000) +
                                     std::string(Core::kLeaseSuffix));
    std::optional<std::vector<uint64_t>> retained;
    std::unique_ptr<File> handle;
    {
      MutexLock ll(&core->lease_lock_mu_);
      OPTSTATE_ASSIGN_OR_RETURN(auto guard, core->LockLeases(LOCK_SH));
      OpenOptions oo;
      oo.create = true;
      oo.exclusive = true;
      auto f = core->fs_->Open(lease, oo);
      if (!f.ok()) return f.status().WithContext("store " + core->path_ + ": take reader lease");
      handle = std::move(*f);
      // Locked before the lease flock is released: the writer's GC, which
      // lists leases under LOCK_EX, never sees this file unlocked while we live.
      while (::flock(handle->fd(), LOCK_EX | LOCK_NB) != 0) {
        if (errno == EINTR) continue;
        const int e = errno;
        handle.reset();
        (void)core->fs_->Remove(lease);
        return ErrnoStatus("store " + core->path_ + ": flock reader lease " + lease, e);
      }
      retained = core->ReadRetained();
    }
    // Without RETAINED (a store last opened by an older writer): a GC that
    // dropped g before the lease existed is in the index by now.
    Status s = retained ? Status() : core->CatchUpChecked(false);
    const bool kept = retained ? std::binary_search(retained->begin(), retained->end(), g) : true;
    MutexLock l(&core->mu_);
    if (s.ok() && kept && core->generations_.count(g)) {
      s = core->CheckIndexOf(g);
      if (s.ok()) {
        auto v = BuildView(core, g);
        v->lease_file = lease;
        v->lease_handle = std::move(handle);
        l.Unlock();
        return NewGenerationView(std::move(v));
      }
      reopen = true;  // g's entries in this index are stale
      why = s;
    } else if (s.ok() && kept) {
      reopen = true;  // the writer keeps g, this index lost it: stale
    }
    l.Unlock();
    (void)core->fs_->Remove(lease);
    handle.reset();
    if (!s.ok() && s.code() != StatusCode::kBusy) return s;
    if (!kept && generation != kLatest && snapshot.empty()) {
      return NotFound("store " + core->path_ + ": generation " + std::to_string(g) +
                      " was collected before a lease could be taken");
    }
  }
  return Busy("store " + core->path_ + ": could not lease a generation after 20 attempts: " + why.ToString());
}

}  // namespace optstate::vfs::internal

namespace optstate::vfs {

Status CheckReaderFilesystem(const std::string& dir) {
  if (::access(dir.c_str(), W_OK) == 0 || errno != EROFS) return Status();
  const std::optional<internal::MountOf> m = internal::FindMountOf(dir);
  if (m && m->filesystem_read_only) return Status();
  if (!m) {
    return FailedPrecondition(dir + " is on a read-only mount and /proc/self/mountinfo does not say whether its "
                                    "filesystem is read-only everywhere: a reader must write a lease in the "
                                    "store's leases/ so that a writer keeps the generation it reads; open it "
                                    "through a writable path");
  }
  return FailedPrecondition(
      dir + " is on a read-only mount (" + m->mount_point +
      ") of a filesystem that is writable elsewhere (a read-only bind mount): a writer there could collect "
      "the generation a reader reads, and a reader cannot write its lease in the store's leases/ here; open it "
      "through a writable path, or mount the filesystem itself read-only (mount -o remount,ro)");
}

}  // namespace optstate::vfs
