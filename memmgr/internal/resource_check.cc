#include "memmgr/internal/resource_check.h"

#include <dirent.h>
#include <sys/resource.h>

#include <cerrno>

namespace optstate::memmgr::internal {

namespace {
// Open descriptors of this process (entries of /proc/self/fd minus the one
// the listing itself uses); -1 where /proc is unavailable.
int OpenDescriptors() {
  DIR* d = opendir("/proc/self/fd");
  if (d == nullptr) return -1;
  int n = 0;
  while (readdir(d) != nullptr) ++n;
  closedir(d);
  return n - 3;  // ".", ".." and the DIR's own descriptor
}
}  // namespace

Status CheckDescriptorHeadroom(const std::string& store_path, int needed) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return ErrnoStatus("getrlimit(RLIMIT_NOFILE)", errno);
  if (rl.rlim_cur == RLIM_INFINITY) return Status::Ok();
  const int in_use = OpenDescriptors();
  if (in_use < 0) return Status::Ok();
  const long long left = static_cast<long long>(rl.rlim_cur) - in_use;
  if (left >= needed) return Status::Ok();
  return ResourceExhausted("MemoryManager for store " + store_path + ": RLIMIT_NOFILE is " +
                           std::to_string(rl.rlim_cur) + " open files and " + std::to_string(in_use) +
                           " are in use; streaming needs at least " + std::to_string(needed) +
                           " more descriptors (io_uring rings, memfd, data and index files). Raise it "
                           "(ulimit -n, LimitNOFILE=) and restart; nothing was changed");
}

}  // namespace optstate::memmgr::internal
