// Runs fio (the reference every optstate benchmark is judged against) and
// parses its JSON output. The harness always asks for io_uring + O_DIRECT so
// that the comparison is with the same kernel path our engine uses.
//
// Thread-safety: free functions; each call runs one fio process.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "base/status.h"

namespace optstate::tools {

struct FioJob {
  std::string name = "job";
  std::string filename;            // a file path (fio's filename=)
  std::string rw = "read";         // read, write, rw, randread, randwrite, randrw
  uint64_t block_size_bytes = 8ull << 20;
  uint32_t iodepth = 32;
  uint64_t size_bytes = 0;
  uint64_t offset_bytes = 0;
  uint32_t rwmixread = 50;         // for rw / randrw
  bool end_fsync = false;          // fsync at the end, included in fio's runtime
  bool stonewall = false;          // wait for the previous jobs before starting
  std::map<std::string, std::string> extra;   // any other fio option
};

struct FioJobResult {
  std::string name;
  uint64_t read_bytes = 0;
  uint64_t write_bytes = 0;
  double runtime_seconds = 0;      // job_runtime (includes end_fsync)
};

struct FioResult {
  std::vector<FioJobResult> jobs;
  std::string version;
};

// True when fio is installed.
bool FioAvailable();

// Runs the jobs in one fio process with ioengine=io_uring, direct=1,
// --output-format=json. Jobs without stonewall run concurrently.
Result<FioResult> RunFio(const std::vector<FioJob>& jobs);

}  // namespace optstate::tools
