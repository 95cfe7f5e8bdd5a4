#include "vfs/fault_injection.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <filesystem>
#include <iterator>
#include <random>
#include <set>
#include <utility>

#include "base/log.h"
#include "base/mutex.h"
#include "base/thread_annotations.h"

namespace optstate::vfs {
namespace {

constexpr uint64_t kBlock = 4096;
constexpr uint64_t kMaxSavedReplacedBytes = 16ull << 20;

std::string Norm(const std::string& path) {
  std::string s = std::filesystem::path(path).lexically_normal().string();
  while (s.size() > 1 && s.back() == '/') s.pop_back();
  return s;
}

std::string DirOf(const std::string& normalized) {
  size_t slash = normalized.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return normalized.substr(0, slash);
}

bool IsUnder(const std::string& p, const std::string& root) {
  return p == root || (p.size() > root.size() && p.compare(0, root.size(), root) == 0 && p[root.size()] == '/');
}

std::string OpWhat(OpClass op, const std::string& path, uint64_t offset, uint64_t len) {
  std::string s(OpClassName(op));
  s += ' ';
  s += path;
  if (op == OpClass::kRead || op == OpClass::kWrite || op == OpClass::kFallocate || op == OpClass::kIndexWrite) {
    s += " offset ";
    s += std::to_string(offset);
    s += " length ";
    s += std::to_string(len);
  }
  return s;
}

}  // namespace

// The state behind the hooks: rules, counters and what is not yet durable.
class FaultInjectionFileSystem::Hooks final : public FaultHooks {
 public:
  explicit Hooks(FileSystem* base) : base_(base) {}

  Status BeforeOp(OpClass op, const std::string& path, uint64_t offset, uint64_t len,
                  uint64_t* short_len) override {
    MutexLock lock(&mu_);
    if (!active_) {
      return ErrnoStatus("fault injection: filesystem inactive (simulated crash): " + OpWhat(op, path, offset, len),
                         EIO);
    }
    ++counts_[static_cast<size_t>(op)];
    ++total_;
    const bool transfer = op == OpClass::kRead || op == OpClass::kWrite || op == OpClass::kIndexWrite;
    std::optional<Status> fail;
    std::optional<uint64_t> shorten;
    for (size_t i = 0; i < rules_.size(); ++i) {
      RuleState& rs = rules_[i];
      const FaultRule& r = rs.rule;
      if (!r.any_class && r.op != op) continue;
      if (!r.path_contains.empty() && path.find(r.path_contains) == std::string::npos) continue;
      ++rs.seen;  // every matching rule keeps counting
      if (!(rs.seen == r.nth || (r.persistent && rs.seen > r.nth))) continue;
      if (r.short_len.has_value()) {
        if (transfer && short_len != nullptr && *r.short_len < len) {
          shorten = std::min(shorten.value_or(UINT64_MAX), *r.short_len);
        }
      } else if (!fail.has_value()) {
        fail = ErrnoStatus("injected fault (rule " + std::to_string(i) + ", " +
                               (r.any_class ? std::string("any op") : std::string(OpClassName(r.op))) +
                               " #" + std::to_string(rs.seen) + (r.persistent ? ", persistent" : "") +
                               "): " + OpWhat(op, path, offset, len),
                           r.err);
      }
    }
    if (fail.has_value()) {
      ++injected_;
      return *fail;
    }
    if (shorten.has_value()) {
      ++injected_;
      *short_len = std::min(*short_len, *shorten);
    }
    return Status::Ok();
  }

  void AfterWrite(const std::string& path, uint64_t offset, uint64_t len) override {
    if (len == 0) return;
    MutexLock lock(&mu_);
    auto& m = unsynced_[Norm(path)];
    uint64_t s = offset, e = offset + len;
    auto it = m.upper_bound(s);
    if (it != m.begin()) {
      auto prev = std::prev(it);
      if (prev->second >= s) {
        s = prev->first;
        e = std::max(e, prev->second);
        it = m.erase(prev);
      }
    }
    while (it != m.end() && it->first <= e) {
      e = std::max(e, it->second);
      it = m.erase(it);
    }
    m[s] = e;
  }

  void AfterSync(const std::string& path) override {
    MutexLock lock(&mu_);
    unsynced_.erase(Norm(path));
  }

  void AfterCreate(const std::string& path) override {
    MutexLock lock(&mu_);
    std::string p = Norm(path);
    created_[p] = DirOf(p);
  }

  void AfterDirSync(const std::string& dir) override {
    MutexLock lock(&mu_);
    std::string d = Norm(dir);
    std::erase_if(created_, [&](const auto& kv) { return kv.second == d; });
    std::erase_if(replaced_, [&](const auto& kv) { return kv.second.dir == d; });
  }

  // A rename made outside the wrapper (RocksDB's files, through the store's
  // hooked rocksdb::FileSystem): save what `to` holds now, then track the
  // rename like one made through FaultInjectionFileSystem::Rename.
  Status BeforeRename(const std::string& from, const std::string& to) override {
    OPTSTATE_RETURN_IF_ERROR(CheckActive("rename " + from + " to " + to));
    PendingRename p;
    auto existed = base_->Exists(to);
    p.to_existed = existed.ok() && *existed;
    if (p.to_existed && NeedsOldContents(to)) p.old_contents = ReadSmallFile(base_, to);
    MutexLock lock(&mu_);
    pending_renames_[{Norm(from), Norm(to)}] = std::move(p);
    return Status::Ok();
  }
  void AfterRename(const std::string& from, const std::string& to) override {
    PendingRename p;
    {
      MutexLock lock(&mu_);
      auto it = pending_renames_.find({Norm(from), Norm(to)});
      if (it == pending_renames_.end()) return;  // no BeforeRename: nothing known about `to`
      p = std::move(it->second);
      pending_renames_.erase(it);
    }
    OnRename(from, to, p.to_existed, std::move(p.old_contents));
  }

  // Contents of a file of at most kMaxSavedReplacedBytes, read through `base`;
  // nullopt if it cannot be read or is larger.
  static std::optional<std::string> ReadSmallFile(FileSystem* base, const std::string& path) {
    auto f = base->Open(path, OpenOptions{.read_only = true});
    if (!f.ok()) return std::nullopt;
    auto size = (*f)->Size();
    if (!size.ok() || *size > kMaxSavedReplacedBytes) return std::nullopt;
    std::string s(*size, '\0');
    if (!(*f)->Pread(0, s.data(), s.size()).ok()) return std::nullopt;
    return s;
  }

  // A rename through the wrapper: tracking follows the file to its new name.
  void OnRename(const std::string& from_raw, const std::string& to_raw, bool to_existed,
                std::optional<std::string> old_to_contents) {
    MutexLock lock(&mu_);
    std::string from = Norm(from_raw), to = Norm(to_raw);
    // A directory rename carries everything tracked below it.
    auto strictly_under = [&](const std::string& k) { return k.size() > from.size() && IsUnder(k, from); };
    auto remap = [&](const std::string& k) { return strictly_under(k) ? to + k.substr(from.size()) : k; };
    std::erase_if(unsynced_, [&](const auto& kv) { return kv.first.size() > to.size() && IsUnder(kv.first, to); });
    for (auto it = unsynced_.begin(); it != unsynced_.end();) {
      if (!strictly_under(it->first)) {
        ++it;
        continue;
      }
      auto node = unsynced_.extract(it++);
      node.key() = remap(node.key());
      unsynced_.insert(std::move(node));
    }
    for (auto it = created_.begin(); it != created_.end();) {
      if (!strictly_under(it->first)) {
        ++it;
        continue;
      }
      std::string key = remap(it->first), dir = remap(it->second);
      it = created_.erase(it);
      created_[key] = dir;
    }
    for (auto it = replaced_.begin(); it != replaced_.end();) {
      if (!strictly_under(it->first)) {
        ++it;
        continue;
      }
      std::string key = remap(it->first);
      Replaced r{remap(it->second.dir), std::move(it->second.old_contents)};
      it = replaced_.erase(it);
      replaced_[key] = std::move(r);
    }
    auto un = unsynced_.find(from);
    if (un != unsynced_.end()) {
      unsynced_[to] = std::move(un->second);
      unsynced_.erase(from);
    } else {
      unsynced_.erase(to);
    }
    const bool from_created = created_.erase(from) > 0;
    const bool to_created = created_.count(to) > 0;
    if (!to_existed || to_created) {
      created_[to] = DirOf(to);  // a new entry in to's directory, not yet durable
    } else if (!replaced_.count(to) && old_to_contents.has_value()) {
      replaced_[to] = Replaced{DirOf(to), std::move(*old_to_contents)};
    }
    // A durable `from` entry would reappear after power loss; not modelled.
    (void)from_created;
  }

  bool NeedsOldContents(const std::string& to_raw) {
    MutexLock lock(&mu_);
    std::string to = Norm(to_raw);
    return !created_.count(to) && !replaced_.count(to);
  }

  void OnRemove(const std::string& path_raw, bool tree) {
    MutexLock lock(&mu_);
    std::string p = Norm(path_raw);
    auto match = [&](const std::string& k) { return tree ? IsUnder(k, p) : k == p; };
    std::erase_if(unsynced_, [&](const auto& kv) { return match(kv.first); });
    std::erase_if(created_, [&](const auto& kv) { return match(kv.first); });
    std::erase_if(replaced_, [&](const auto& kv) { return match(kv.first); });
  }

  Status Drop(FileSystem* base, DropMode mode, uint64_t seed) {
    MutexLock lock(&mu_);
    std::mt19937_64 rng(seed);
    std::set<std::string> dirs_to_sync;
    // 1. Unsynced data of files that survive: zeros over lost blocks.
    std::vector<char> zeros(1 << 20, 0);
    for (const auto& [path, ranges] : unsynced_) {
      bool removed = false;
      for (const auto& [c, dir] : created_) removed |= IsUnder(path, c);
      if (removed) continue;
      auto f = base->Open(path, OpenOptions{});
      if (!f.ok()) {
        if (f.status().IsNotFound()) continue;
        return f.status().WithContext("drop unsynced data");
      }
      for (const auto& [start, end] : ranges) {
        if (mode == DropMode::kAll) {
          for (uint64_t off = start; off < end; off += zeros.size()) {
            uint64_t n = std::min<uint64_t>(zeros.size(), end - off);
            OPTSTATE_RETURN_IF_ERROR((*f)->Pwrite(off, zeros.data(), n).WithContext("drop unsynced data"));
          }
        } else {
          for (uint64_t blk = start / kBlock * kBlock; blk < end; blk += kBlock) {
            if (rng() & 1) continue;  // this block reached the disk
            uint64_t lo = std::max(blk, start), hi = std::min(blk + kBlock, end);
            OPTSTATE_RETURN_IF_ERROR((*f)->Pwrite(lo, zeros.data(), hi - lo).WithContext("drop unsynced data"));
          }
        }
      }
      OPTSTATE_RETURN_IF_ERROR((*f)->Fsync().WithContext("drop unsynced data"));
    }
    // 2. Files replaced by an unsynced rename get their old contents back.
    for (const auto& [path, rep] : replaced_) {
      OPTSTATE_RETURN_IF_ERROR(base->WriteFileAtomic(path, rep.old_contents).WithContext("drop unsynced rename"));
    }
    // 3. Entries created since their directory's last sync disappear.
    for (const auto& [path, dir] : created_) {
      OPTSTATE_RETURN_IF_ERROR(base->RemoveAll(path).WithContext("drop unsynced creation"));
      dirs_to_sync.insert(dir);
    }
    for (const auto& d : dirs_to_sync) {
      Status s = base->SyncDir(d);
      if (!s.ok() && !s.IsNotFound()) return s.WithContext("drop unsynced data");
    }
    OPTSTATE_LOG_DEBUG("fault injection: dropped unsynced data of {} files, {} creations, {} renames",
                       unsynced_.size(), created_.size(), replaced_.size());
    unsynced_.clear();
    created_.clear();
    replaced_.clear();
    return Status::Ok();
  }

  void AddRule(const FaultRule& r) {
    MutexLock lock(&mu_);
    rules_.push_back(RuleState{r, 0});
  }
  void ClearRules() {
    MutexLock lock(&mu_);
    rules_.clear();
  }
  uint64_t OpCount(OpClass op) const {
    MutexLock lock(&mu_);
    return counts_[static_cast<size_t>(op)];
  }
  uint64_t Total() const {
    MutexLock lock(&mu_);
    return total_;
  }
  uint64_t Injected() const {
    MutexLock lock(&mu_);
    return injected_;
  }
  void ResetCounters() {
    MutexLock lock(&mu_);
    counts_.fill(0);
    total_ = 0;
    injected_ = 0;
  }
  void SetActive(bool a) {
    MutexLock lock(&mu_);
    active_ = a;
  }
  bool active() const {
    MutexLock lock(&mu_);
    return active_;
  }
  Status CheckActive(const std::string& what) const {
    if (active()) return Status::Ok();
    return ErrnoStatus("fault injection: filesystem inactive (simulated crash): " + what, EIO);
  }
  void MarkAllSynced() {
    MutexLock lock(&mu_);
    unsynced_.clear();
    created_.clear();
    replaced_.clear();
  }
  uint64_t UnsyncedBytes() const {
    MutexLock lock(&mu_);
    uint64_t n = 0;
    for (const auto& [p, m] : unsynced_) {
      for (const auto& [s, e] : m) n += e - s;
    }
    return n;
  }
  std::vector<std::string> Replacements() const {
    MutexLock lock(&mu_);
    std::vector<std::string> out;
    for (const auto& kv : replaced_) out.push_back(kv.first);
    return out;
  }
  std::vector<std::string> Creations() const {
    MutexLock lock(&mu_);
    std::vector<std::string> out;
    for (const auto& kv : created_) out.push_back(kv.first);
    return out;
  }

 private:
  struct RuleState {
    FaultRule rule;
    uint64_t seen = 0;  // matching operations since the rule was added
  };
  struct Replaced {
    std::string dir;
    std::string old_contents;
  };
  struct PendingRename {
    bool to_existed = false;
    std::optional<std::string> old_contents;
  };

  FileSystem* const base_;  // not owned
  mutable Mutex mu_;
  bool active_ GUARDED_BY(mu_) = true;
  std::array<uint64_t, 256> counts_ GUARDED_BY(mu_){};
  uint64_t total_ GUARDED_BY(mu_) = 0;
  uint64_t injected_ GUARDED_BY(mu_) = 0;
  std::vector<RuleState> rules_ GUARDED_BY(mu_);
  std::map<std::string, std::map<uint64_t, uint64_t>> unsynced_ GUARDED_BY(mu_);  // path -> [start, end)
  std::map<std::string, std::string> created_ GUARDED_BY(mu_);                     // path -> its directory
  std::map<std::string, Replaced> replaced_ GUARDED_BY(mu_);                       // path -> contents before
  // Renames between BeforeRename and AfterRename: (from, to) -> what `to` was.
  std::map<std::pair<std::string, std::string>, PendingRename> pending_renames_ GUARDED_BY(mu_);
};

namespace {

// A File of the wrapped file system with the wrapper's hooks in every call.
class FaultFile final : public File {
 public:
  FaultFile(std::unique_ptr<File> base, FaultHooks* hooks) : base_(std::move(base)), hooks_(hooks) {}

  const std::string& path() const override { return base_->path(); }
  int fd() const override { return base_->fd(); }
  bool direct() const override { return base_->direct(); }
  FaultHooks* hooks() const override { return hooks_; }

  Status Pread(uint64_t offset, void* buf, uint64_t len) const override {
    uint64_t first = len;
    OPTSTATE_RETURN_IF_ERROR(hooks_->BeforeOp(OpClass::kRead, path(), offset, len, &first));
    first = ShortPiece(first, len);
    if (first < len) {
      OPTSTATE_RETURN_IF_ERROR(base_->Pread(offset, buf, first));
      return base_->Pread(offset + first, static_cast<char*>(buf) + first, len - first);
    }
    return base_->Pread(offset, buf, len);
  }

  Status Pwrite(uint64_t offset, const void* buf, uint64_t len) override {
    uint64_t first = len;
    OPTSTATE_RETURN_IF_ERROR(hooks_->BeforeOp(OpClass::kWrite, path(), offset, len, &first));
    first = ShortPiece(first, len);
    if (first < len) {
      OPTSTATE_RETURN_IF_ERROR(base_->Pwrite(offset, buf, first));
      hooks_->AfterWrite(path(), offset, first);
      OPTSTATE_RETURN_IF_ERROR(base_->Pwrite(offset + first, static_cast<const char*>(buf) + first, len - first));
    } else {
      OPTSTATE_RETURN_IF_ERROR(base_->Pwrite(offset, buf, len));
    }
    hooks_->AfterWrite(path(), offset, len);
    return Status::Ok();
  }

  Status Fdatasync() override {
    OPTSTATE_RETURN_IF_ERROR(hooks_->BeforeOp(OpClass::kSync, path(), 0, 0, nullptr));
    OPTSTATE_RETURN_IF_ERROR(base_->Fdatasync());
    hooks_->AfterSync(path());
    return Status::Ok();
  }
  Status Fsync() override {
    OPTSTATE_RETURN_IF_ERROR(hooks_->BeforeOp(OpClass::kSync, path(), 0, 0, nullptr));
    OPTSTATE_RETURN_IF_ERROR(base_->Fsync());
    hooks_->AfterSync(path());
    return Status::Ok();
  }
  Status Fallocate(uint64_t offset, uint64_t len) override {
    OPTSTATE_RETURN_IF_ERROR(hooks_->BeforeOp(OpClass::kFallocate, path(), offset, len, nullptr));
    return base_->Fallocate(offset, len);
  }
  Result<uint64_t> Size() const override { return base_->Size(); }

 private:
  // The length of the first piece of a short transfer (block-aligned for
  // O_DIRECT files, which cannot move a partial block).
  uint64_t ShortPiece(uint64_t first, uint64_t len) const {
    if (first >= len) return len;
    if (base_->direct()) first -= first % kBlock;
    return first;
  }

  std::unique_ptr<File> base_;
  FaultHooks* const hooks_;
};

}  // namespace

FaultInjectionFileSystem::FaultInjectionFileSystem(FileSystem* base)
    : base_(base), hooks_(std::make_unique<Hooks>(base)) {}
FaultInjectionFileSystem::~FaultInjectionFileSystem() = default;

void FaultInjectionFileSystem::AddRule(const FaultRule& rule) { hooks_->AddRule(rule); }
void FaultInjectionFileSystem::ClearRules() { hooks_->ClearRules(); }
uint64_t FaultInjectionFileSystem::OpCount(OpClass op) const { return hooks_->OpCount(op); }
uint64_t FaultInjectionFileSystem::TotalOpCount() const { return hooks_->Total(); }
uint64_t FaultInjectionFileSystem::InjectedCount() const { return hooks_->Injected(); }
void FaultInjectionFileSystem::ResetCounters() { hooks_->ResetCounters(); }
void FaultInjectionFileSystem::SetFilesystemActive(bool active) { hooks_->SetActive(active); }
bool FaultInjectionFileSystem::filesystem_active() const { return hooks_->active(); }
Status FaultInjectionFileSystem::DropUnsyncedData(DropMode mode, uint64_t seed) {
  return hooks_->Drop(base_, mode, seed);
}
void FaultInjectionFileSystem::MarkAllSynced() { hooks_->MarkAllSynced(); }
uint64_t FaultInjectionFileSystem::UnsyncedBytes() const { return hooks_->UnsyncedBytes(); }
std::vector<std::string> FaultInjectionFileSystem::UnsyncedCreations() const { return hooks_->Creations(); }
std::vector<std::string> FaultInjectionFileSystem::UnsyncedReplacements() const { return hooks_->Replacements(); }
FaultHooks* FaultInjectionFileSystem::hooks() const { return hooks_.get(); }

Result<std::unique_ptr<File>> FaultInjectionFileSystem::Open(const std::string& path, const OpenOptions& opts) {
  OPTSTATE_RETURN_IF_ERROR(hooks_->BeforeOp(OpClass::kOpen, path, 0, 0, nullptr));
  bool existed = true;
  if (opts.create) {
    OPTSTATE_ASSIGN_OR_RETURN(existed, base_->Exists(path));
  }
  OPTSTATE_ASSIGN_OR_RETURN(std::unique_ptr<File> f, base_->Open(path, opts));
  if (!existed) hooks_->AfterCreate(path);
  return std::unique_ptr<File>(std::make_unique<FaultFile>(std::move(f), hooks_.get()));
}

Status FaultInjectionFileSystem::CreateDir(const std::string& path) {
  OPTSTATE_RETURN_IF_ERROR(hooks_->BeforeOp(OpClass::kMetadata, path, 0, 0, nullptr));
  // The highest missing ancestor is the one new entry in an existing directory.
  std::string p = Norm(path);
  std::string first_missing;
  for (std::string q = p; !q.empty() && q != "/" && q != ".";) {
    OPTSTATE_ASSIGN_OR_RETURN(bool e, base_->Exists(q));
    if (e) break;
    first_missing = q;
    std::string parent = DirOf(q);
    if (parent == q) break;
    q = parent;
  }
  OPTSTATE_RETURN_IF_ERROR(base_->CreateDir(path));
  if (!first_missing.empty()) hooks_->AfterCreate(first_missing);
  return Status::Ok();
}

Status FaultInjectionFileSystem::SyncDir(const std::string& path) {
  OPTSTATE_RETURN_IF_ERROR(hooks_->BeforeOp(OpClass::kSync, path, 0, 0, nullptr));
  OPTSTATE_RETURN_IF_ERROR(base_->SyncDir(path));
  hooks_->AfterDirSync(path);
  return Status::Ok();
}

Status FaultInjectionFileSystem::Rename(const std::string& from, const std::string& to) {
  OPTSTATE_RETURN_IF_ERROR(hooks_->BeforeOp(OpClass::kMetadata, from, 0, 0, nullptr));
  OPTSTATE_ASSIGN_OR_RETURN(bool to_existed, base_->Exists(to));
  std::optional<std::string> old;
  if (to_existed && hooks_->NeedsOldContents(to)) old = Hooks::ReadSmallFile(base_, to);
  OPTSTATE_RETURN_IF_ERROR(base_->Rename(from, to));
  hooks_->OnRename(from, to, to_existed, std::move(old));
  return Status::Ok();
}

Status FaultInjectionFileSystem::Remove(const std::string& path) {
  OPTSTATE_RETURN_IF_ERROR(hooks_->BeforeOp(OpClass::kMetadata, path, 0, 0, nullptr));
  OPTSTATE_RETURN_IF_ERROR(base_->Remove(path));
  hooks_->OnRemove(path, false);
  return Status::Ok();
}

Status FaultInjectionFileSystem::RemoveAll(const std::string& path) {
  OPTSTATE_RETURN_IF_ERROR(hooks_->BeforeOp(OpClass::kMetadata, path, 0, 0, nullptr));
  OPTSTATE_RETURN_IF_ERROR(base_->RemoveAll(path));
  hooks_->OnRemove(path, true);
  return Status::Ok();
}

Result<bool> FaultInjectionFileSystem::Exists(const std::string& path) {
  OPTSTATE_RETURN_IF_ERROR(hooks_->CheckActive("stat " + path));
  return base_->Exists(path);
}

Result<std::vector<std::string>> FaultInjectionFileSystem::ListDir(const std::string& path) {
  OPTSTATE_RETURN_IF_ERROR(hooks_->CheckActive("list " + path));
  return base_->ListDir(path);
}

Result<std::string> FaultInjectionFileSystem::ReadFileToString(const std::string& path) {
  OPTSTATE_ASSIGN_OR_RETURN(std::unique_ptr<File> f, Open(path, OpenOptions{.read_only = true}));
  OPTSTATE_ASSIGN_OR_RETURN(uint64_t size, f->Size());
  std::string out(size, '\0');
  OPTSTATE_RETURN_IF_ERROR(f->Pread(0, out.data(), size));
  return out;
}

Status FaultInjectionFileSystem::WriteFileAtomic(const std::string& path, const std::string& contents) {
  static std::atomic<uint64_t> counter{0};
  std::string tmp = path + ".tmp.fi." + std::to_string(counter++);
  Status s = [&]() -> Status {
    OPTSTATE_ASSIGN_OR_RETURN(std::unique_ptr<File> f, Open(tmp, OpenOptions{.create = true, .exclusive = true}));
    OPTSTATE_RETURN_IF_ERROR(f->Pwrite(0, contents.data(), contents.size()));
    OPTSTATE_RETURN_IF_ERROR(f->Fsync());
    return Status::Ok();
  }();
  if (s.ok()) s = Rename(tmp, path);
  if (!s.ok()) {
    // Best effort, straight to the base: the failure being reported matters more.
    if (hooks_->active()) {
      (void)base_->Remove(tmp);
      hooks_->OnRemove(tmp, false);
    }
    return s.WithContext("write " + path + " atomically");
  }
  return SyncDir(DirOf(Norm(path))).WithContext("write " + path + " atomically");
}

}  // namespace optstate::vfs
