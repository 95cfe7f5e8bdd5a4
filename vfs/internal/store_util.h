// Small helpers of the store's files: I/O alignment, paths, wall time, the
// catalog's chunk key, the flock guard and the closest-name hint of
// NotFound messages. Internal to vfs/.
#pragma once

#include <sys/file.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/strings.h"
#include "vfs/file_system.h"
#include "vfs/internal/store_format.h"
#include "vfs/store.h"

namespace optstate::vfs::internal {

inline constexpr uint64_t kIoAlign = 4096;
inline constexpr uint64_t kInfinity = UINT64_MAX;

inline uint64_t RoundUp(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

inline int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

inline std::string JoinPath(const std::string& a, const std::string& b) {
  if (a.empty()) return b;
  return a.back() == '/' ? a + b : a + "/" + b;
}

inline std::string AbsPath(const std::string& p) {
  std::error_code ec;
  auto abs = std::filesystem::absolute(p, ec);
  if (ec) return p;
  std::string s = abs.lexically_normal().string();
  while (s.size() > 1 && s.back() == '/') s.pop_back();
  return s;
}

struct Key {
  uint32_t t = 0;
  uint32_t f = 0;
  uint64_t c = 0;
  auto operator<=>(const Key&) const = default;
};

struct Version {
  uint64_t gen = 0;  // written (published) generation
  Extent ext;
  // The chunk-map pack record of generation gen that holds it (1, 2, ...;
  // store_format.h "P/"), or 0: its own "C/" record (format version 1).
  uint32_t pack = 0;
};

// flock on an open File's fd; released on destruction.
class FlockGuard {
 public:
  FlockGuard() = default;
  static Result<FlockGuard> Take(File* f, int op) {
    for (;;) {
      if (::flock(f->fd(), op) == 0) break;
      if (errno == EINTR) continue;
      return ErrnoStatus("flock " + f->path(), errno);
    }
    FlockGuard g;
    g.fd_ = f->fd();
    return g;
  }
  FlockGuard(FlockGuard&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  FlockGuard& operator=(FlockGuard&& o) noexcept {
    std::swap(fd_, o.fd_);
    return *this;
  }
  ~FlockGuard() {
    if (fd_ >= 0) ::flock(fd_, LOCK_UN);
  }

 private:
  int fd_ = -1;
};

// "; closest: 'a', 'b', 'c'" over `names`, or "" when there are none.
template <typename It>
std::string ClosestNames(std::string_view want, It begin, It end) {
  std::vector<std::pair<size_t, std::string>> scored;
  for (It it = begin; it != end; ++it) scored.emplace_back(EditDistance(want, *it), *it);
  if (scored.empty()) return "; the store has no tensors";
  std::sort(scored.begin(), scored.end());
  std::string s = "; closest:";
  for (size_t i = 0; i < scored.size() && i < 3; ++i) s += (i ? ", '" : " '") + scored[i].second + "'";
  return s;
}

}  // namespace optstate::vfs::internal
