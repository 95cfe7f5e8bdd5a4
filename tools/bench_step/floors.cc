// optstate-bench step's floors: the I/O floor (fio reading and writing the
// state's bytes at once, end_fsync) and the copy floor (H2D and D2H bandwidth).
#include <algorithm>
#include <cstring>
#include <vector>

#include "tools/bench_step/compare.h"
#include "tools/internal/cli.h"
#include "tools/internal/device_buffer.h"
#include "tools/internal/fio.h"

namespace optstate::tools::bench::step {

Status RunFioFloor(const Comparison& cmp, CompareResults* res) {
  // The floor: read state_bytes and write state_bytes at the same time.
  FioJob rd;
  rd.name = "read";
  rd.filename = cmp.dir + "/floor.read";
  rd.rw = "read";
  rd.block_size_bytes = cmp.c.chunk;
  rd.iodepth = cmp.o.queue_depth;
  rd.size_bytes = cmp.state_bytes / cmp.c.chunk * cmp.c.chunk;
  FioJob wr = rd;
  wr.name = "write";
  wr.filename = cmp.dir + "/floor.write";
  wr.rw = "write";
  wr.end_fsync = true;
  DiskCounters before = ReadDiskCounters(cmp.disk_path);
  auto f = RunFio({rd, wr});
  if (!f.ok()) return f.status().WithContext("fio floor");
  double t = 0;
  for (auto& j : f->jobs) t = std::max(t, j.runtime_seconds);
  res->disk_floor.Add(before, ReadDiskCounters(cmp.disk_path), t);
  res->t_floor.push_back(t * static_cast<double>(cmp.state_bytes) / static_cast<double>(rd.size_bytes));
  return Status::Ok();
}

Status MeasureCopies(memmgr::MemoryManager* mm, double* h2d, double* d2h) {
  const uint64_t bytes = 1ull << 30;
  OPTSTATE_ASSIGN_OR_RETURN(void* h, mm->AllocPinnedHost(bytes));
  struct Free {
    memmgr::MemoryManager* mm;
    void* h;
    uint64_t n;
    ~Free() { mm->FreePinnedHost(h, n); }
  } free_h{mm, h, bytes};
  std::memset(h, 1, bytes);
  OPTSTATE_ASSIGN_OR_RETURN(DeviceBuffer d, DeviceBuffer::Make(mm, bytes));
  std::vector<double> a, b;
  for (int i = 0; i < 5; ++i) {
    double t0 = NowSeconds();
    OPTSTATE_RETURN_IF_ERROR(mm->CopyToDevice(d.get(), h, bytes));
    double t1 = NowSeconds();
    OPTSTATE_RETURN_IF_ERROR(mm->CopyToHost(h, d.get(), bytes));
    double t2 = NowSeconds();
    a.push_back(static_cast<double>(bytes) / (t1 - t0));
    b.push_back(static_cast<double>(bytes) / (t2 - t1));
  }
  *h2d = Median(a);
  *d2h = Median(b);
  return Status::Ok();
}

}  // namespace optstate::tools::bench::step
