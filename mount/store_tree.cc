#include "mount/store_tree.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "base/log.h"

namespace optstate::mount {

namespace {

using Clock = std::chrono::steady_clock;

std::vector<std::string> SplitPath(std::string_view p) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i < p.size()) {
    while (i < p.size() && p[i] == '/') ++i;
    size_t j = p.find('/', i);
    if (j == std::string_view::npos) j = p.size();
    if (j > i) out.emplace_back(p.substr(i, j - i));
    i = j;
  }
  return out;
}

bool HasIdentity(const std::string& dir) {
  struct stat st;
  return ::stat((dir + "/IDENTITY").c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// Field `n` (1-based, as proc(5) counts) of /proc/<pid>/stat, or none.
std::optional<uint64_t> ProcStatField(uint32_t pid, int n) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(in, line)) return std::nullopt;
  // The command name (field 2) is in parentheses and may hold spaces.
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return std::nullopt;
  std::istringstream rest(line.substr(close + 1));
  std::string v;
  for (int i = 3; i <= n; ++i) {
    if (!(rest >> v)) return std::nullopt;
  }
  return std::strtoull(v.c_str(), nullptr, 10);
}

// The thread group (process) of thread `tid`, from /proc/<tid>/status, or none.
std::optional<uint32_t> ThreadGroupOf(uint32_t tid) {
  std::ifstream in("/proc/" + std::to_string(tid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("Tgid:", 0) == 0) return static_cast<uint32_t>(std::strtoul(line.c_str() + 5, nullptr, 10));
  }
  return std::nullopt;
}

// A generation's directory name under generations/ ("17"), or none.
std::optional<uint64_t> ParseGenerationName(const std::string& name) {
  if (name.empty() || name.size() > 19 || (name.size() > 1 && name[0] == '0')) return std::nullopt;
  for (char ch : name) {
    if (ch < '0' || ch > '9') return std::nullopt;
  }
  return std::strtoull(name.c_str(), nullptr, 10);
}

}  // namespace

int64_t SteadyNowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch()).count();
}

void LatestPin::Touch() { last_use_ms.store(SteadyNowMs(), std::memory_order_relaxed); }

PinUse::PinUse(std::shared_ptr<LatestPin> pin) : pin_(std::move(pin)) {
  pin_->open_handles.fetch_add(1, std::memory_order_relaxed);
  pin_->Touch();
}

PinUse::~PinUse() {
  pin_->Touch();  // idles from the last close on
  pin_->open_handles.fetch_sub(1, std::memory_order_relaxed);
}

uint64_t InodeOf(std::string_view path) {
  uint64_t h = vfs::ChunkChecksum(path.data(), path.size());
  return h < 2 ? h + 2 : h;
}

uint64_t TreeInodeOf(const Generation& g, std::string_view rel, std::string_view path) {
  if (rel.empty()) return InodeOf(path);
  auto it = g.tree_rank.find(std::string(rel));
  constexpr uint64_t kRankBits = 24;
  if (it == g.tree_rank.end() || it->second + 1 >= (1ull << kRankBits)) return InodeOf(path);
  return (g.inode_base << kRankBits) | (it->second + 1);  // never 0 or 1: base >= 1
}

bool FillsSafetensors(const MountOptions& o) {
  switch (o.fill_safetensors) {
    case MountOptions::Fill::kOn: return true;
    case MountOptions::Fill::kOff: return false;
    case MountOptions::Fill::kAuto: return std::thread::hardware_concurrency() >= 8;
  }
  return false;
}

Result<std::vector<std::string>> GenerationDirNames(const vfs::CheckpointLayout& layout, std::string_view rel) {
  OPTSTATE_ASSIGN_OR_RETURN(std::vector<std::string> names, layout.ListDir(rel));
  if (rel.empty()) {
    auto it = std::find(names.begin(), names.end(), vfs::kSafetensorsFileName);
    if (it != names.end()) std::rotate(it, it + 1, names.end());
  }
  return names;
}

Status IndexTree(Generation* g) {
  // The generation's number in the hash: latest/'s files have other inode
  // numbers in each generation, as they have other node ids.
  std::string key = "/" + g->store_name + "/" + g->dir_label;
  key.push_back('\0');
  key += std::to_string(g->generation());
  uint64_t h = InodeOf(key) >> 24;
  g->inode_base = h == 0 ? 1 : h;
  auto visit = [&](auto&& self, const std::string& dir) -> Status {
    OPTSTATE_ASSIGN_OR_RETURN(std::vector<std::string> names, GenerationDirNames(*g->layout, dir));
    for (const std::string& name : names) {
      std::string rel = dir.empty() ? name : dir + "/" + name;
      g->tree_rank.emplace(rel, static_cast<uint32_t>(g->tree_rank.size()));
      if (g->layout->IsDir(rel)) {
        OPTSTATE_RETURN_IF_ERROR(self(self, rel));
      } else if (const vfs::CheckpointFile* f = g->layout->FindFile(rel); f != nullptr) {
        g->file_position.emplace(f, static_cast<uint32_t>(g->files_in_tree_order.size()));
        g->files_in_tree_order.push_back(f);
      }
    }
    return Status();
  };
  return visit(visit, "");
}

struct StoreTree::StoreEntry {
  std::string name;
  std::string path;
  std::weak_ptr<StoreEntry> self;
  Mutex mu ACQUIRED_BEFORE(pins_mu);  // guards the members marked so below
  std::unique_ptr<vfs::Store> store GUARDED_BY(mu);
  Clock::time_point last_catchup GUARDED_BY(mu){};
  std::shared_ptr<const Generation> latest GUARDED_BY(mu);
  std::map<std::string, vfs::SnapshotInfo> snapshot_list GUARDED_BY(mu);  // escaped name -> info
  std::map<std::string, std::shared_ptr<const Generation>> snapshots GUARDED_BY(mu);  // escaped name
  std::vector<uint64_t> retained GUARDED_BY(mu);                                      // ascending
  // generations/<g> served, each kept (with its lease) until it has gone
  // unused for latest_pin_idle_ms (SweepPins); open files hold their own.
  struct Served {
    std::shared_ptr<const Generation> gen;
    int64_t last_use_ms = 0;  // steady clock
  };
  std::map<uint64_t, Served> generations GUARDED_BY(mu);
  // latest/ per process (StoreTree's header comment).
  Mutex pins_mu;
  std::map<ProcessKey, std::shared_ptr<LatestPin>> pins GUARDED_BY(pins_mu);
};

StoreTree::StoreTree(MountOptions opts) : opts_(std::move(opts)) {}
// Generations hold their StoreEntry (store_keepalive) and the entry caches its
// Generations: break that cycle whenever an entry leaves the tree.
static void DropCached(StoreTree::StoreEntry* e) EXCLUDES(e->mu, e->pins_mu) {
  MutexLock lock(&e->mu);
  e->latest.reset();
  e->snapshots.clear();
  e->generations.clear();
  MutexLock pl(&e->pins_mu);
  e->pins.clear();
}

StoreTree::~StoreTree() {
  for (auto& [name, e] : stores_) DropCached(e.get());
}

Result<std::shared_ptr<StoreTree::StoreEntry>> StoreTree::GetStore(const std::string& name) {
  if (name == "." || name == ".." || name.empty()) return NotFound("no store " + name);
  const std::string path = opts_.store_root + "/" + name;
  MutexLock lock(&mu_);
  auto it = stores_.find(name);
  if (!HasIdentity(path)) {
    if (it != stores_.end()) {
      OPTSTATE_LOG_INFO("optstate-mount: store {} disappeared from {}", name, opts_.store_root);
      DropCached(it->second.get());
      stores_.erase(it);
    }
    return NotFound(fmt::format("no store {} under {}", name, opts_.store_root));
  }
  if (it != stores_.end()) return it->second;
  vfs::StoreOptions so;
  auto store = vfs::Store::OpenReadOnly(path, so);
  if (!store.ok()) {
    OPTSTATE_LOG_WARN("optstate-mount: cannot open store {}: {}", path, store.status().ToString());
    return store.status();
  }
  auto e = std::make_shared<StoreEntry>();
  e->name = name;
  e->path = path;
  {
    MutexLock l(&e->mu);  // not shared yet: for the analysis
    e->store = std::move(store).value();
  }
  e->self = e;
  stores_[name] = e;
  OPTSTATE_LOG_INFO("optstate-mount: serving store {} ({})", name, path);
  return e;
}

// A Generation of store e served at dir_label, over view.
static Result<std::shared_ptr<const Generation>> MakeGeneration(StoreTree::StoreEntry* e, std::string dir_label,
                                                                std::unique_ptr<vfs::GenerationView> view) {
  auto gen = std::make_shared<Generation>();
  gen->store_keepalive = e->self.lock();
  gen->store_name = e->name;
  gen->dir_label = std::move(dir_label);
  gen->view = std::move(view);
  auto layout = vfs::CheckpointLayout::Build(gen->view.get());
  if (!layout.ok()) return layout.status();
  gen->layout = std::move(layout).value();
  OPTSTATE_RETURN_IF_ERROR(IndexTree(gen.get()));
  return std::shared_ptr<const Generation>(std::move(gen));
}

Status StoreTree::Refresh(StoreEntry* e, bool force) REQUIRES(e->mu) {
  auto now = Clock::now();
  if (!force && e->last_catchup != Clock::time_point{} &&
      now - e->last_catchup < std::chrono::milliseconds(opts_.catchup_interval_ms)) {
    return Status();
  }
  e->last_catchup = now;
  OPTSTATE_RETURN_IF_ERROR(e->store->CatchUp());
  uint64_t g = e->store->LatestGeneration().generation;
  if (g == 0) {
    e->latest.reset();  // nothing committed yet: no latest/
  } else if (!e->latest || e->latest->generation() != g) {
    auto view = e->store->OpenGeneration(vfs::kLatest);
    if (!view.ok()) return view.status();
    OPTSTATE_ASSIGN_OR_RETURN(e->latest, MakeGeneration(e, "latest", std::move(view).value()));
  }
  e->retained.clear();
  for (const vfs::GenerationInfo& i : e->store->ListGenerations()) e->retained.push_back(i.generation);
  for (auto it = e->generations.begin(); it != e->generations.end();) {
    if (!std::binary_search(e->retained.begin(), e->retained.end(), it->first)) {
      it = e->generations.erase(it);  // no longer retained: open files keep their Generation
    } else {
      ++it;
    }
  }
  std::map<std::string, vfs::SnapshotInfo> list;
  for (vfs::SnapshotInfo& s : e->store->ListSnapshots()) {
    list[vfs::FileNameForName(s.name)] = std::move(s);
  }
  for (auto it = e->snapshots.begin(); it != e->snapshots.end();) {
    auto l = list.find(it->first);
    if (l == list.end() || l->second.generation != it->second->generation()) {
      it = e->snapshots.erase(it);  // released: open files keep their Generation
    } else {
      ++it;
    }
  }
  e->snapshot_list = std::move(list);
  return Status();
}

std::optional<StoreTree::ProcessKey> StoreTree::Identify(uint32_t caller_tid) {
  if (caller_tid == 0) return std::nullopt;
  const int64_t now = SteadyNowMs();
  {
    MutexLock l(&ids_mu_);
    auto it = threads_.find(caller_tid);
    // A thread id is reused only after its thread ended and the pid space
    // wrapped around: a second's trust costs nothing.
    if (it != threads_.end() && now - it->second.checked_ms < 1000) return it->second.process;
  }
  std::optional<uint32_t> tgid = ThreadGroupOf(caller_tid);
  if (!tgid) return std::nullopt;
  std::optional<uint64_t> start = ProcStatField(*tgid, 22);  // starttime
  if (!start) return std::nullopt;
  ProcessKey key{*tgid, *start};
  MutexLock l(&ids_mu_);
  if (threads_.size() > 4096) {
    for (auto it = threads_.begin(); it != threads_.end();) {
      it = now - it->second.checked_ms >= 1000 ? threads_.erase(it) : std::next(it);
    }
  }
  threads_[caller_tid] = KnownThread{key, now};
  return key;
}

bool StoreTree::PinExpired(const ProcessKey& who, const LatestPin& pin, int64_t now_ms) const {
  if (pin.open_handles.load(std::memory_order_relaxed) <= 0 &&
      now_ms - pin.last_use_ms.load(std::memory_order_relaxed) > static_cast<int64_t>(opts_.latest_pin_idle_ms)) {
    return true;
  }
  std::optional<uint64_t> start = ProcStatField(who.tgid, 22);
  return !start || *start != who.start_ticks;  // exited (or its pid reused)
}

Result<std::shared_ptr<const Generation>> StoreTree::Latest(StoreEntry* e, uint32_t caller_tid) REQUIRES(e->mu) {
  const std::optional<ProcessKey> who = Identify(caller_tid);
  std::shared_ptr<LatestPin> ended;  // destroyed after pins_mu is released
  if (who) {
    MutexLock l(&e->pins_mu);
    auto it = e->pins.find(*who);
    if (it != e->pins.end()) {
      // The caller is alive (it asks): only idleness can end its pin here.
      const LatestPin& p = *it->second;
      if (p.open_handles.load(std::memory_order_relaxed) > 0 ||
          SteadyNowMs() - p.last_use_ms.load(std::memory_order_relaxed) <=
              static_cast<int64_t>(opts_.latest_pin_idle_ms)) {
        it->second->Touch();
        return it->second->gen;
      }
      ended = std::move(it->second);
      e->pins.erase(it);
    }
  }
  OPTSTATE_RETURN_IF_ERROR(Refresh(e, false));
  if (!e->latest) return NotFound(fmt::format("store {}: no committed generation yet", e->name));
  if (who) {
    auto pin = std::make_shared<LatestPin>();
    pin->gen = e->latest;
    pin->Touch();
    MutexLock l(&e->pins_mu);
    e->pins[*who] = std::move(pin);
  }
  return e->latest;
}

std::shared_ptr<LatestPin> StoreTree::PinOf(const Generation& gen, uint32_t caller_tid) {
  if (gen.dir_label != "latest") return nullptr;
  const std::optional<ProcessKey> who = Identify(caller_tid);
  if (!who) return nullptr;
  auto* e = static_cast<StoreEntry*>(gen.store_keepalive.get());
  MutexLock l(&e->pins_mu);
  auto it = e->pins.find(*who);
  if (it == e->pins.end() || it->second->gen.get() != &gen) return nullptr;
  it->second->Touch();
  return it->second;
}

size_t StoreTree::SweepPins() {
  std::vector<std::shared_ptr<StoreEntry>> entries;
  {
    MutexLock l(&mu_);
    for (const auto& [name, e] : stores_) entries.push_back(e);
  }
  const int64_t now = SteadyNowMs();
  size_t left = 0;
  for (const std::shared_ptr<StoreEntry>& e : entries) {
    std::vector<std::shared_ptr<const Generation>> unused;  // destroyed after e->mu is released
    {
      MutexLock l(&e->mu);
      for (auto it = e->generations.begin(); it != e->generations.end();) {
        if (now - it->second.last_use_ms > static_cast<int64_t>(opts_.latest_pin_idle_ms)) {
          unused.push_back(std::move(it->second.gen));
          it = e->generations.erase(it);
        } else {
          ++it;
        }
      }
    }
    std::vector<std::shared_ptr<LatestPin>> ended;  // destroyed after pins_mu is released
    MutexLock l(&e->pins_mu);
    for (auto it = e->pins.begin(); it != e->pins.end();) {
      if (PinExpired(it->first, *it->second, now)) {
        ended.push_back(std::move(it->second));
        it = e->pins.erase(it);
      } else {
        ++it;
      }
    }
    left += e->pins.size();
  }
  return left;
}

Result<std::shared_ptr<const Generation>> StoreTree::Retained(StoreEntry* e, const std::string& name)
    REQUIRES(e->mu) {
  const std::optional<uint64_t> g = ParseGenerationName(name);
  if (!g) return NotFound(fmt::format("store {}: no generation {} (generations are numbers)", e->name, name));
  auto it = e->generations.find(*g);
  if (it != e->generations.end() &&
      Clock::now() - e->last_catchup < std::chrono::milliseconds(opts_.snapshot_recheck_ms)) {
    it->second.last_use_ms = SteadyNowMs();
    return it->second.gen;  // held and recently confirmed retained, as for snapshots
  }
  OPTSTATE_RETURN_IF_ERROR(Refresh(e, false));
  it = e->generations.find(*g);
  if (it != e->generations.end()) {
    it->second.last_use_ms = SteadyNowMs();
    return it->second.gen;
  }
  if (!std::binary_search(e->retained.begin(), e->retained.end(), *g)) {
    OPTSTATE_RETURN_IF_ERROR(Refresh(e, true));  // committed since the last catch-up?
    if (!std::binary_search(e->retained.begin(), e->retained.end(), *g)) {
      return NotFound(fmt::format("store {}: generation {} is not retained", e->name, *g));
    }
  }
  // The latest/ Generation of the same number shares nothing with this one
  // but the store: its node ids and inode numbers come from its own path.
  auto view = e->store->OpenGeneration(*g);
  if (!view.ok()) return view.status();
  OPTSTATE_ASSIGN_OR_RETURN(std::shared_ptr<const Generation> gen,
                            MakeGeneration(e, "generations/" + name, std::move(view).value()));
  e->generations[*g] = StoreEntry::Served{gen, SteadyNowMs()};
  return gen;
}

Result<std::shared_ptr<const Generation>> StoreTree::Snapshot(StoreEntry* e, const std::string& name)
    REQUIRES(e->mu) {
  auto it = e->snapshots.find(name);
  if (it != e->snapshots.end() &&
      Clock::now() - e->last_catchup < std::chrono::milliseconds(opts_.snapshot_recheck_ms)) {
    return it->second;  // held and recently confirmed: no catch-up (MountOptions::snapshot_recheck_ms)
  }
  OPTSTATE_RETURN_IF_ERROR(Refresh(e, false));
  it = e->snapshots.find(name);
  if (it != e->snapshots.end()) return it->second;
  auto l = e->snapshot_list.find(name);
  if (l == e->snapshot_list.end()) {
    // Created since the last catch-up?
    OPTSTATE_RETURN_IF_ERROR(Refresh(e, true));
    l = e->snapshot_list.find(name);
    if (l == e->snapshot_list.end()) {
      return NotFound(fmt::format("store {}: no snapshot {}", e->name, name));
    }
  }
  auto view = e->store->OpenSnapshot(l->second.name);
  if (!view.ok()) return view.status();
  OPTSTATE_ASSIGN_OR_RETURN(std::shared_ptr<const Generation> gen,
                            MakeGeneration(e, "snapshots/" + name, std::move(view).value()));
  e->snapshots[name] = gen;
  return gen;
}

Result<Node> StoreTree::Resolve(std::string_view path, uint32_t caller_tid) {
  std::vector<std::string> parts = SplitPath(path);
  Node n;
  if (parts.empty()) return n;
  n.store = parts[0];
  OPTSTATE_ASSIGN_OR_RETURN(std::shared_ptr<StoreEntry> e, GetStore(parts[0]));
  MutexLock lock(&e->mu);
  // The store's own node and its snapshots/ change with no commit (only
  // their mtime, which may be as old as the last catch-up): they resolve
  // without one. A path walk looks the store up every time (its name is not
  // cached), and a catch-up every catchup_interval_ms there was most of what
  // the daemon did between a `cp -r`'s files: the RocksDB secondary's catch-up
  // reloads the index and opened table files through a pool of 16 new threads.
  auto first_refresh = [&]() REQUIRES(e->mu) -> Status {
    return e->last_catchup == Clock::time_point{} ? Refresh(e.get(), false) : Status();
  };
  if (parts.size() == 1) {
    n.kind = NodeKind::kStore;
    OPTSTATE_RETURN_IF_ERROR(first_refresh());
    n.mtime_unix_ms = e->latest ? e->latest->view->info().commit_time_unix_ms : 0;
    return n;
  }
  size_t rel_start;
  if (parts[1] == "latest") {
    OPTSTATE_ASSIGN_OR_RETURN(n.gen, Latest(e.get(), caller_tid));
    rel_start = 2;
  } else if (parts[1] == "generations") {
    if (parts.size() == 2) {
      n.kind = NodeKind::kGenerationsDir;
      OPTSTATE_RETURN_IF_ERROR(first_refresh());
      n.mtime_unix_ms = e->latest ? e->latest->view->info().commit_time_unix_ms : 0;
      return n;
    }
    OPTSTATE_ASSIGN_OR_RETURN(n.gen, Retained(e.get(), parts[2]));
    rel_start = 3;
  } else if (parts[1] == "snapshots") {
    if (parts.size() == 2) {
      n.kind = NodeKind::kSnapshotsDir;
      OPTSTATE_RETURN_IF_ERROR(first_refresh());
      n.mtime_unix_ms = e->latest ? e->latest->view->info().commit_time_unix_ms : 0;
      return n;
    }
    OPTSTATE_ASSIGN_OR_RETURN(n.gen, Snapshot(e.get(), parts[2]));
    rel_start = 3;
  } else {
    return NotFound(fmt::format("store {}: no entry {}", e->name, parts[1]));
  }
  lock.Unlock();
  std::string rel;
  for (size_t i = rel_start; i < parts.size(); ++i) {
    if (!rel.empty()) rel += "/";
    rel += parts[i];
  }
  return ResolveIn(std::move(n.gen), rel, path);
}

Result<Node> StoreTree::ResolveIn(std::shared_ptr<const Generation> gen, std::string_view rel,
                                  std::string_view path) {
  Node n;
  n.store = gen->store_name;
  n.mtime_unix_ms = gen->view->info().commit_time_unix_ms;
  n.rel = std::string(rel);
  n.gen = std::move(gen);
  if (n.gen->layout->IsDir(n.rel)) {
    n.kind = NodeKind::kGenDir;
    return n;
  }
  n.file = n.gen->layout->FindFile(n.rel);
  if (n.file == nullptr) return NotFound(fmt::format("{}: no such file", path));
  n.kind = NodeKind::kGenFile;
  return n;
}

Result<std::vector<std::string>> StoreTree::List(const Node& dir) {
  switch (dir.kind) {
    case NodeKind::kRoot: {
      std::vector<std::string> out;
      DIR* d = ::opendir(opts_.store_root.c_str());
      if (d == nullptr) return ErrnoStatus("opendir " + opts_.store_root, errno);
      while (dirent* de = ::readdir(d)) {
        std::string name = de->d_name;
        if (name == "." || name == "..") continue;
        if (HasIdentity(opts_.store_root + "/" + name)) out.push_back(name);
      }
      ::closedir(d);
      std::sort(out.begin(), out.end());
      return out;
    }
    case NodeKind::kStore: {
      OPTSTATE_ASSIGN_OR_RETURN(std::shared_ptr<StoreEntry> e, GetStore(dir.store));
      MutexLock lock(&e->mu);
      OPTSTATE_RETURN_IF_ERROR(Refresh(e.get(), false));
      if (!e->latest) return std::vector<std::string>{"generations", "snapshots"};
      return std::vector<std::string>{"generations", "latest", "snapshots"};
    }
    case NodeKind::kGenerationsDir: {
      OPTSTATE_ASSIGN_OR_RETURN(std::shared_ptr<StoreEntry> e, GetStore(dir.store));
      MutexLock lock(&e->mu);
      OPTSTATE_RETURN_IF_ERROR(Refresh(e.get(), true));
      std::vector<std::string> out;
      for (uint64_t g : e->retained) out.push_back(std::to_string(g));
      return out;  // by number, ascending: the newest last
    }
    case NodeKind::kSnapshotsDir: {
      OPTSTATE_ASSIGN_OR_RETURN(std::shared_ptr<StoreEntry> e, GetStore(dir.store));
      MutexLock lock(&e->mu);
      OPTSTATE_RETURN_IF_ERROR(Refresh(e.get(), true));
      std::vector<std::string> out;
      for (const auto& [name, info] : e->snapshot_list) out.push_back(name);
      return out;  // std::map: sorted
    }
    case NodeKind::kGenDir:
      return GenerationDirNames(*dir.gen->layout, dir.rel);
    case NodeKind::kGenFile:
      return InvalidArgument("not a directory");
  }
  return Internal("bad node");
}

}  // namespace optstate::mount
