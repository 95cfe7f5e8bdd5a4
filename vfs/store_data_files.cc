// The data files of a store (Core, vfs/internal/store_core.h): where the data
// dirs recorded in IDENTITY are for this store directory, opening the files, and
// the writer's claim on them (flock and owner record) that keeps two stores
// from ever writing one data file.
#include "vfs/internal/store_core.h"
#include "vfs/internal/store_open.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace optstate::vfs::internal {

Status OpenDataFiles(Core* core, bool create_missing) {
  const auto& dirs = core->identity_.data_dirs;
  core->data_files_.resize(dirs.size());
  for (uint32_t d = 0; d < dirs.size(); ++d) {
    if (core->data_files_[d]) continue;
    const std::string name = core->FileName(d);
    OPTSTATE_ASSIGN_OR_RETURN(bool exists, core->fs_->Exists(name));
    if (!exists && !create_missing) continue;  // checked against references later
    OpenOptions oo;
    oo.read_only = core->read_only_;
    oo.create = !exists;
    oo.direct = core->opts_.direct_io;
    auto f = core->fs_->Open(name, oo);
    if (!f.ok()) return f.status().WithContext("store " + core->path_ + ": data file");
    core->data_files_[d] = std::move(*f);
    if (!exists) {
      OPTSTATE_RETURN_IF_ERROR(core->data_files_[d]->Fsync());
      OPTSTATE_RETURN_IF_ERROR(core->fs_->SyncDir(dirs[d]));
    }
  }
  return Status();
}

// What a user can do to get a second, independent store from one.
const char* const kIndependentCopyHint =
    "to make an independent copy of a store, copy a checkpoint of it (`cp -r MOUNT/<store>/latest DIR` from "
    "optstate-mount, or a snapshot's directory) and import it with `optstate-restore DIR NEW_STORE --create NAME`";

// Turns the data dirs recorded in IDENTITY into absolute paths for this store
// directory (identity_.data_dirs) and marks which lie inside it. A relative
// dir is inside. An absolute one was written by an older version, which
// recorded every dir absolute: inside this directory, it is inside; naming a
// dir of the directory the store was created in (this one is a copy or was
// moved), this directory's own copy of it is used, recognised by this store's
// data file being there; inside any other store directory, refused (the copy
// would write another store's data file). Others are external.
Status ResolveDataDirs(Core* c) {
  auto& dirs = c->identity_.data_dirs;
  c->internal_dirs_.assign(dirs.size(), false);
  const std::string data_file = c->identity_.uuid + ".chunks";
  for (size_t d = 0; d < dirs.size(); ++d) {
    const std::string rec = dirs[d];
    if (!rec.starts_with("/")) {
      dirs[d] = rec == "." ? c->path_ : AbsPath(JoinPath(c->path_, rec));
      c->internal_dirs_[d] = true;
      continue;
    }
    if (internal::RelativeToStore(rec, c->path_)) {
      c->internal_dirs_[d] = true;
      c->identity_needs_rewrite_ = true;
      continue;
    }
    std::vector<std::string> parts;
    for (const auto& part : std::filesystem::path(rec)) {
      if (!part.empty() && part != "/") parts.push_back(part.string());
    }
    std::string rel;
    for (size_t k = parts.size(); k-- > 0 && !c->internal_dirs_[d];) {
      rel = rel.empty() ? parts[k] : parts[k] + "/" + rel;
      const std::string here = JoinPath(c->path_, rel);
      auto e = c->fs_->Exists(JoinPath(here, data_file));
      if (e.ok() && *e) {
        OPTSTATE_LOG_INFO("store {}: data dir {} recorded by an older version is this store directory's {}", c->path_,
                          rec, here);
        dirs[d] = here;
        c->internal_dirs_[d] = true;
        c->identity_needs_rewrite_ = true;
      }
    }
    if (c->internal_dirs_[d]) continue;
    for (std::filesystem::path a(rec); !a.empty(); a = a.parent_path()) {
      const std::string anc = a.string();
      auto e = c->fs_->Exists(JoinPath(anc, "IDENTITY"));
      if (e.ok() && *e && anc != c->path_) {
        return FailedPrecondition(
            "store " + c->path_ + ": IDENTITY names data dir " + rec + ", which lies inside the store directory " +
            anc + ", and this directory has no copy of it (no " + rel + "/" + data_file +
            "): this store is a copy of " + anc + " (or was moved from there) made without its data, and opening it "
            "would use that store's data file. Copy the whole store directory with `cp -a`, or " +
            kIndependentCopyHint);
      }
      if (anc == "/") break;
    }
  }
  return Status();
}

// Writer: makes each open data file this store directory's, or refuses. The
// data file is flock'ed (LOCK_EX) for as long as it is open, so no two
// processes ever write it; its owner record (<uuid>.owner) names the store
// directory that writes it. A record naming another directory is taken over
// when the data file is not the one that directory wrote (a copy of the store
// directory copied it: its inode differs); the same data file owned by another
// directory (a copied store sharing an external data dir, or a hard-linked
// copy) is refused.
Status ClaimDataFiles(Core* c) {
  struct stat self;
  if (::stat(c->path_.c_str(), &self) != 0) return ErrnoStatus("store " + c->path_ + ": stat", errno);
  c->claimed_.resize(c->data_files_.size(), false);
  c->data_locks_.resize(c->data_files_.size());
  for (uint32_t d = 0; d < c->data_files_.size(); ++d) {
    File* f = c->data_files_[d].get();
    if (f == nullptr || c->claimed_[d]) continue;
    const std::string file = c->FileName(d);
    const std::string owner_path = JoinPath(c->identity_.data_dirs[d], c->identity_.uuid + ".owner");
    auto owner_text = c->fs_->ReadFileToString(owner_path);
    std::optional<internal::DataFileOwner> owner;
    if (owner_text.ok()) {
      auto o = internal::DecodeDataFileOwner(*owner_text, owner_path);
      if (o.ok()) {
        owner = std::move(*o);
      } else {
        OPTSTATE_LOG_WARN("store {}: {}; rewriting it", c->path_, o.status().ToString());
      }
    } else if (!owner_text.status().IsNotFound()) {
      return owner_text.status().WithContext("store " + c->path_ + ": owner record of data file " + file);
    }
    const std::string other = owner ? owner->store_path : std::string("unknown (no owner record)");
    OpenOptions lo;
    lo.read_only = true;
    auto lock = c->fs_->Open(file, lo);
    if (!lock.ok()) return lock.status().WithContext("store " + c->path_ + ": lock of data file");
    for (;;) {
      if (::flock((*lock)->fd(), LOCK_EX | LOCK_NB) == 0) break;
      const int e = errno;
      if (e == EINTR) continue;
      if (e == EWOULDBLOCK) {
        return Status(StatusCode::kBusy,
                      "store " + c->path_ + ": data file " + file + " is open for writing by another process, a "
                      "writer of store " + other + ": two stores never write one data file. The two are copies "
                      "of one store that share a data dir outside them (or hard-linked copies); close the other "
                      "writer and use one of them, or " + kIndependentCopyHint,
                      e);
      }
      return ErrnoStatus("store " + c->path_ + ": flock data file " + file, e);
    }
    struct statx st;
    if (::statx(f->fd(), "", AT_EMPTY_PATH, STATX_INO | STATX_NLINK | STATX_BTIME, &st) != 0) {
      return ErrnoStatus("store " + c->path_ + ": statx " + file, errno);
    }
    if (st.stx_nlink > 1) {
      return FailedPrecondition("store " + c->path_ + ": data file " + file + " has " +
                                std::to_string(st.stx_nlink) +
                                " hard links: another store directory may share it (a copy made with `cp -l` "
                                "or `rsync --link-dest`). Copy a store with `cp -a`, or " + kIndependentCopyHint);
    }
    internal::DataFileOwner mine;
    mine.uuid = c->identity_.uuid;
    mine.store_path = c->path_;
    mine.store_dev = static_cast<uint64_t>(self.st_dev);
    mine.store_ino = static_cast<uint64_t>(self.st_ino);
    mine.data_dev = (uint64_t{st.stx_dev_major} << 32) | st.stx_dev_minor;
    mine.data_ino = st.stx_ino;
    if (st.stx_mask & STATX_BTIME) {
      mine.data_btime_ns = static_cast<uint64_t>(st.stx_btime.tv_sec) * 1000000000ull + st.stx_btime.tv_nsec;
    }
    bool write = true;
    if (owner) {
      // Same directory: same inode, and same device or same path (device
      // numbers of drives can change across reboots; a rename keeps both).
      const bool same_dir = owner->store_ino == mine.store_ino &&
                            (owner->store_dev == mine.store_dev || owner->store_path == mine.store_path);
      const bool same_file = owner->data_ino == mine.data_ino &&
                             (owner->data_btime_ns == 0 || mine.data_btime_ns == 0 ||
                              owner->data_btime_ns == mine.data_btime_ns) &&
                             (owner->data_dev == mine.data_dev || same_dir);
      if (owner->uuid != mine.uuid) {
        return FailedPrecondition("store " + c->path_ + ": data file " + file + " has an owner record (" +
                                  owner_path + ") of another store, uuid " + owner->uuid +
                                  "; the data directory was tampered with: " + kIndependentCopyHint);
      }
      if (same_dir) {
        write = owner->store_path != mine.store_path || owner->store_dev != mine.store_dev ||
                owner->data_dev != mine.data_dev || owner->data_ino != mine.data_ino ||
                owner->data_btime_ns != mine.data_btime_ns;
      } else if (!same_file) {
        OPTSTATE_LOG_INFO("store {}: data file {} is this store directory's own copy (its owner record named {}); "
                          "taking it over", c->path_, file, owner->store_path);
      } else {
        struct stat o;
        const bool other_exists = ::stat(owner->store_path.c_str(), &o) == 0 &&
                                  static_cast<uint64_t>(o.st_ino) == owner->store_ino;
        return FailedPrecondition(
            "store " + c->path_ + ": data file " + file + " belongs to the store directory " + owner->store_path +
            (other_exists ? " (which still exists)" : " (which is no longer there)") +
            ": this store is a copy of it, or it was moved or restored from a backup, and its data dir " +
            c->identity_.data_dirs[d] +
            (c->internal_dirs_[d] ? " is the same directory for both (a symbolic link or mount copied as such)"
                                  : " lies outside the store directory") +
            ", so a copy would write the same data file. A store whose data dirs are not its own cannot be "
            "copied with cp; " + kIndependentCopyHint +
            ". If this directory replaces " + owner->store_path + " (moved, or the only copy left) and no other "
            "copy will be opened, delete " + owner_path + " and open it again");
      }
    }
    if (write) {
      OPTSTATE_RETURN_IF_ERROR(c->fs_->WriteFileAtomic(owner_path, internal::EncodeDataFileOwner(mine))
                                   .WithContext("store " + c->path_ + ": owner record of data file " + file));
    }
    c->data_locks_[d] = std::move(*lock);
    c->claimed_[d] = true;
  }
  return Status();
}

Status CheckReferencedFiles(Core* core) {
  for (const auto& [key, vs] : core->versions_) {
    for (const auto& v : vs) {
      if (v.ext.dir >= core->data_files_.size() || !core->data_files_[v.ext.dir]) {
        return Corruption("store " + core->path_ + ": data file " +
                          (v.ext.dir < core->identity_.data_dirs.size() ? core->FileName(v.ext.dir)
                                                                         : "#" + std::to_string(v.ext.dir)) +
                          " is missing but generation " + std::to_string(v.gen) + " references it");
      }
    }
  }
  return Status();
}

}  // namespace optstate::vfs::internal
