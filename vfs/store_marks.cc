// The marks the writer keeps outside RocksDB (Core, vfs/internal/store_core.h):
// COMMITTED, the newest acknowledged generation (two slots, synced per commit),
// and RETAINED, the generations whose chunk versions GC keeps (read by readers
// under the shared lease flock).
#include "vfs/internal/store_core.h"
#include "vfs/internal/store_open.h"

namespace optstate::vfs::internal {

std::string Core::EncodeRetained(const std::vector<uint64_t>& gens) {
  std::string rec(16 + 8 * gens.size() + 8, '\0');
  std::memcpy(rec.data(), "OSRETAIN", 8);
  const uint64_t n = gens.size();
  std::memcpy(rec.data() + 8, &n, 8);
  if (n > 0) std::memcpy(rec.data() + 16, gens.data(), 8 * n);
  const uint64_t sum = ChunkChecksum(rec.data(), rec.size() - 8);
  std::memcpy(rec.data() + rec.size() - 8, &sum, 8);
  return rec;
}

Result<std::vector<uint64_t>> Core::DecodeRetained(const std::string& rec, const std::string& where) {
  uint64_t n = 0, sum = 0;
  if (rec.size() < 24 || std::memcmp(rec.data(), "OSRETAIN", 8) != 0) {
    return Corruption(where + ": not a RETAINED record (" + std::to_string(rec.size()) + " bytes)");
  }
  std::memcpy(&n, rec.data() + 8, 8);
  if (n > (rec.size() - 24) / 8) return Corruption(where + ": count " + std::to_string(n) + " overruns the file");
  std::memcpy(&sum, rec.data() + 16 + 8 * n, 8);
  if (sum != ChunkChecksum(rec.data(), 16 + 8 * n)) return Corruption(where + ": checksum mismatch");
  std::vector<uint64_t> gens(n);
  if (n > 0) std::memcpy(gens.data(), rec.data() + 16, 8 * n);
  return gens;
}

std::vector<uint64_t> Core::GenerationNumbers(std::optional<uint64_t> adding) const {
  std::vector<uint64_t> out;
  for (const auto& [g, info] : generations_) out.push_back(g);
  if (adding && (out.empty() || out.back() < *adding)) out.push_back(*adding);
  return out;
}

Status Core::WriteRetained(const std::vector<uint64_t>& gens) {
  if (retained_file_ == nullptr || (retained_written_ && gens == *retained_written_)) return Status();
  const std::string rec = EncodeRetained(gens);
  OPTSTATE_RETURN_IF_ERROR(retained_file_->Pwrite(0, rec.data(), rec.size()).WithContext("store " + path_ +
                                                                                           ": RETAINED"));
  retained_written_ = gens;
  return Status();
}

void Core::RewriteRetainedAfterBatch() {
  if (Status s = WriteRetained(GenerationNumbers()); !s.ok()) {
    OPTSTATE_LOG_WARN("store {}: {} (it still lists generations just collected; the next GC rewrites it)", path_,
                      s.ToString());
  }
}

std::optional<std::vector<uint64_t>> Core::ReadRetained() {
  auto text = fs_->ReadFileToString(JoinPath(path_, "RETAINED"));
  if (text.status().IsNotFound()) return std::nullopt;
  if (!text.ok()) {
    OPTSTATE_LOG_WARN("store {}: RETAINED unreadable ({}); checking leases against the index", path_,
                      text.status().ToString());
    return std::nullopt;
  }
  auto gens = DecodeRetained(*text, "store " + path_ + ": RETAINED");
  if (!gens.ok()) {
    OPTSTATE_LOG_WARN("{}; checking leases against the index", gens.status().ToString());
    return std::nullopt;
  }
  return std::move(gens).value();
}

std::string Core::EncodeCommittedMark(uint64_t gen) {
  std::string rec(32, '\0');
  std::memcpy(rec.data(), "OSCOMMIT", 8);
  std::memcpy(rec.data() + 8, &gen, 8);
  const uint64_t sum = ChunkChecksum(rec.data(), 16);
  std::memcpy(rec.data() + 16, &sum, 8);
  return rec;
}

Result<uint64_t> Core::DecodeCommittedMark(const std::string& rec, const std::string& where) {
  uint64_t gen = 0, sum = 0;
  if (rec.size() < 32 || std::memcmp(rec.data(), "OSCOMMIT", 8) != 0) {
    return Corruption(where + ": not a COMMITTED record (" + std::to_string(rec.size()) + " bytes)");
  }
  std::memcpy(&gen, rec.data() + 8, 8);
  std::memcpy(&sum, rec.data() + 16, 8);
  if (sum != ChunkChecksum(rec.data(), 16)) return Corruption(where + ": checksum mismatch");
  return gen;
}

std::optional<uint64_t> Core::NewestCommittedMark(const std::string& contents, const std::string& where,
                                                  std::string* why) {
  std::optional<uint64_t> best;
  for (uint64_t slot = 0; slot < 2; ++slot) {
    if (contents.size() < slot * kMarkSlotBytes + 32) continue;
    auto g = DecodeCommittedMark(contents.substr(slot * kMarkSlotBytes, 32),
                                 where + " slot " + std::to_string(slot));
    if (g.ok()) {
      best = std::max(best.value_or(0), *g);
    } else {
      *why = g.status().ToString();
    }
  }
  return best;
}

std::string Core::CommittedRecoveryHint(uint64_t latest) const {
  auto g = generations_.find(latest);
  const std::string step = g == generations_.end() ? "" : " (step " + std::to_string(g->second.step) + ")";
  return "What you can do: if `optstate-inspect " + path_ + " verify` finds no other problem and generation " +
         std::to_string(latest) + step + " is the last one you committed, accept the index as it is with `touch " +
         JoinPath(path_, kAcceptIndexFile) + "` and open the store again; otherwise copy its newest good "
         "generation or a snapshot out (optstate-mount: `cp -r MOUNT/<store>/latest DIR`) and restore it into a "
         "new store with `optstate-restore DIR NEW_STORE --create NAME`";
}

void Core::VerifyMarks(uint64_t index_latest, std::vector<std::string>* problems) {
  const std::string name = JoinPath(path_, "COMMITTED");
  std::string hint;
  {
    MutexLock l(&mu_);
    hint = CommittedRecoveryHint(index_latest);
  }
  for (int attempt = 0;; ++attempt) {
    auto text = fs_->ReadFileToString(name);
    std::string problem;
    if (!text.ok()) {
      if (!text.status().IsNotFound()) {
        problem = "store " + path_ + ": COMMITTED is unreadable: " + text.status().ToString();
      } else if (index_latest > 0) {
        problem = "store " + path_ + " is damaged: COMMITTED is missing, but the index holds committed "
                  "generations up to " + std::to_string(index_latest) + ". " + hint;
      }
    } else if (index_latest > 0 || !text->empty()) {
      std::string why;
      const auto best = NewestCommittedMark(*text, "COMMITTED", &why);
      if (text->size() < kCommittedBytes) {
        problem = "store " + path_ + " is damaged: COMMITTED is " +
                  (text->empty() ? std::string("empty") : "truncated to " + std::to_string(text->size()) +
                                                              " bytes (" + std::to_string(kCommittedBytes) +
                                                              " written)") +
                  ". " + hint;
      } else if (!best || !why.empty()) {
        problem = "store " + path_ + " is damaged: COMMITTED " +
                  (best ? "has a damaged slot (" + why + "; the other holds generation " +
                              std::to_string(*best) + ")"
                        : "holds no valid record (" + why + ")") +
                  ". " + hint;
      } else if (!read_only_ && *best != index_latest) {
        problem = "store " + path_ + ": COMMITTED acknowledges generation " + std::to_string(*best) +
                  " but the index's latest is " + std::to_string(index_latest);
      }
    }
    if (problem.empty()) break;
    if (!read_only_ || attempt == 2) {
      problems->push_back(problem);
      break;
    }
  }
  // RETAINED, read as readers read it (under the shared lease flock).
  Result<std::string> text = std::string();
  {
    MutexLock ll(&lease_lock_mu_);
    auto guard = LockLeases(LOCK_SH);
    if (!guard.ok()) {
      problems->push_back(guard.status().ToString());
      return;
    }
    text = fs_->ReadFileToString(JoinPath(path_, "RETAINED"));
  }
  const std::string fix = ": readers then check their leases against their own copy of the index only. Opening "
                          "the store read-write (any training step, or `optstate-restore`) rewrites it";
  if (!text.ok()) {
    problems->push_back("store " + path_ + ": RETAINED is " +
                        (text.status().IsNotFound() ? std::string("missing") : "unreadable (" + text.status().ToString() + ")") + fix);
    return;
  }
  auto gens = DecodeRetained(*text, "store " + path_ + ": RETAINED");
  if (!gens.ok()) {
    problems->push_back(gens.status().ToString() + fix);
    return;
  }
  if (read_only_) return;  // the writer may have moved on since this reader's index
  MutexLock l(&mu_);
  for (const auto& [g, info] : generations_) {
    if (!std::binary_search(gens->begin(), gens->end(), g)) {
      problems->push_back("store " + path_ + ": RETAINED lacks retained generation " + std::to_string(g) + fix);
    }
  }
}

uint64_t Core::ReadAckedGeneration() {
  auto text = fs_->ReadFileToString(JoinPath(path_, "COMMITTED"));
  std::string why;
  return text.ok() ? NewestCommittedMark(*text, "COMMITTED", &why).value_or(0) : 0;
}

Status Core::WriteCommittedMark(uint64_t gen, bool both_slots) {
  if (committed_file_ == nullptr) return Status();
  const std::string rec = EncodeCommittedMark(gen);
  for (uint64_t slot : {gen % 2, (gen + 1) % 2}) {
    OPTSTATE_RETURN_IF_ERROR(committed_file_->Pwrite(slot * kMarkSlotBytes, rec.data(), rec.size()));
    if (!both_slots) break;
  }
  return committed_file_->Fdatasync();
}

// Opens (creating if absent) COMMITTED and refuses an index older than the
// generation it records: the acknowledged generations must all be there. A
// store whose index holds committed generations must have a whole COMMITTED
// (missing, empty, truncated or with no valid slot is damage: no crash makes
// it so, and without it a lost index write-ahead log would go unnoticed),
// unless the user accepted the index as it is (kAcceptIndexFile).
Status OpenCommittedMark(Core* c) {
  const std::string name = JoinPath(c->path_, "COMMITTED");
  const std::string accept = JoinPath(c->path_, Core::kAcceptIndexFile);
  OPTSTATE_ASSIGN_OR_RETURN(bool exists, c->fs_->Exists(name));
  OPTSTATE_ASSIGN_OR_RETURN(bool accepted, c->fs_->Exists(accept));
  OpenOptions oo;
  oo.create = !exists;
  std::unique_ptr<File> f;
  uint64_t size = 0;
  uint64_t index_latest = 0;
  {
    // Not shared yet: the lock is for the analysis (and costs nothing).
    MutexLock l(&c->mu_);
    index_latest = c->latest_.generation;
  }
  if (exists || index_latest == 0 || accepted) {
    auto opened = c->fs_->Open(name, oo);
    if (!opened.ok()) return opened.status().WithContext("store " + c->path_ + ": COMMITTED");
    f = std::move(*opened);
    OPTSTATE_ASSIGN_OR_RETURN(size, f->Size());
  }
  MutexLock l(&c->mu_);
  std::string damage;  // what is wrong with COMMITTED, if anything
  std::optional<uint64_t> acked;
  bool both_valid = false;
  if (!exists) {
    damage = "is missing";
  } else if (size == 0) {
    damage = "is empty";
  } else {
    // The newest valid slot; an invalid slot is a torn or lost unsynced write.
    std::string contents(std::min<uint64_t>(size, Core::kCommittedBytes), '\0');
    Status rs = f->Pread(0, contents.data(), contents.size());
    if (!rs.ok()) return rs.WithContext("store " + c->path_ + ": COMMITTED");
    std::string why;
    acked = Core::NewestCommittedMark(contents, "slot", &why);
    both_valid = acked && why.empty();
    if (size < Core::kCommittedBytes) {
      damage = "is truncated to " + std::to_string(size) + " bytes (" + std::to_string(Core::kCommittedBytes) +
               " written)";
    } else if (!acked) {
      damage = "holds no valid record (" + why + ")";
    }
  }
  std::string problem;
  if (!damage.empty() && index_latest > 0) {
    problem = "store " + c->path_ + " is damaged: COMMITTED " + damage +
              ", but the index (index/) holds committed generations up to " + std::to_string(index_latest) +
              ": the store cannot tell whether the index lost acknowledged generations. ";
  } else if (acked && index_latest < *acked) {
    problem = "store " + c->path_ + " is damaged: its index (RocksDB, index/) holds generation " +
              std::to_string(index_latest) + " but generation " + std::to_string(*acked) +
              " was committed and acknowledged (COMMITTED): the index write-ahead log was lost or damaged; "
              "refusing to open an older state silently. ";
  }
  if (!problem.empty()) {
    if (!accepted) return Corruption(problem + c->CommittedRecoveryHint(index_latest));
    OPTSTATE_LOG_WARN("{}{} exists: accepting the index as it is, generation {}", problem, accept, index_latest);
  }
  if (damage.empty() && both_valid && acked == index_latest) {
    c->committed_file_ = std::move(f);
  } else {
    // A fresh store (or one whose creation crashed before COMMITTED was
    // written), an index ahead of the mark (a crash after the commit batch,
    // before the mark), a torn slot, or the user's acceptance: both slots anew.
    if (f == nullptr) {
      auto opened = c->fs_->Open(name, oo);
      if (!opened.ok()) return opened.status().WithContext("store " + c->path_ + ": COMMITTED");
      f = std::move(*opened);
    }
    c->committed_file_ = std::move(f);
    OPTSTATE_RETURN_IF_ERROR(
        c->WriteCommittedMark(index_latest, /*both_slots=*/true).WithContext("store " + c->path_ + ": COMMITTED"));
    if (!exists) OPTSTATE_RETURN_IF_ERROR(c->fs_->SyncDir(c->path_));
  }
  if (accepted) {
    OPTSTATE_RETURN_IF_ERROR(c->fs_->Remove(accept).WithContext("store " + c->path_));
    OPTSTATE_RETURN_IF_ERROR(c->fs_->SyncDir(c->path_));
  }
  return Status();
}

}  // namespace optstate::vfs::internal
