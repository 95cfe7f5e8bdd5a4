// Filesystems a test mounts for itself (as root): a tmpfs it can remount
// read-only, and read-only bind mounts. Tests skip (with the reason) where
// mount(2) is not permitted. Each is detached at destruction (umount2
// MNT_DETACH), so a test that fails midway leaves no mount behind.
#pragma once

#include <sys/mount.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>

namespace optstate::test_util {

class ScratchMount {
 public:
  // A tmpfs of `size_mib` at `dir` (created if missing); ok() says whether
  // it is mounted, error() why not.
  static ScratchMount Tmpfs(const std::string& dir, int size_mib = 256) {
    ScratchMount m(dir);
    const std::string opts = "size=" + std::to_string(size_mib) + "m";
    m.Check(::mount("tmpfs", dir.c_str(), "tmpfs", 0, opts.c_str()) == 0, "mount -t tmpfs");
    return m;
  }
  // A read-only bind mount of `src` at `dir`: read-only here, while `src`'s
  // filesystem stays writable.
  static ScratchMount ReadOnlyBind(const std::string& src, const std::string& dir) {
    ScratchMount m(dir);
    if (m.Check(::mount(src.c_str(), dir.c_str(), nullptr, MS_BIND, nullptr) == 0, "mount --bind") &&
        !m.Check(::mount(nullptr, dir.c_str(), nullptr, MS_REMOUNT | MS_BIND | MS_RDONLY, nullptr) == 0,
                 "mount -o remount,bind,ro")) {
      ::umount2(dir.c_str(), MNT_DETACH);
      m.mounted_ = false;
    }
    return m;
  }

  ScratchMount(ScratchMount&& o) noexcept : dir_(std::move(o.dir_)), mounted_(o.mounted_), error_(o.error_) {
    o.mounted_ = false;
  }
  ScratchMount& operator=(ScratchMount&&) = delete;
  ~ScratchMount() { Unmount(); }

  bool ok() const { return mounted_; }
  const std::string& error() const { return error_; }
  const std::string& dir() const { return dir_; }

  // The whole filesystem (its superblock) read-only: `mount -o remount,ro`.
  bool RemountReadOnly() {
    return Check(::mount(nullptr, dir_.c_str(), nullptr, MS_REMOUNT | MS_RDONLY, nullptr) == 0, "mount -o remount,ro");
  }
  void Unmount() {
    if (mounted_) ::umount2(dir_.c_str(), MNT_DETACH);
    mounted_ = false;
  }

 private:
  explicit ScratchMount(std::string dir) : dir_(std::move(dir)) {
    std::error_code ec;
    std::filesystem::create_directories(dir_, ec);
  }
  bool Check(bool ok, const char* what) {
    if (ok) {
      mounted_ = true;
      return true;
    }
    error_ = std::string(what) + " " + dir_ + ": " + std::strerror(errno) + " (tests mount as root)";
    return false;
  }

  std::string dir_;
  bool mounted_ = false;
  std::string error_;
};

}  // namespace optstate::test_util
