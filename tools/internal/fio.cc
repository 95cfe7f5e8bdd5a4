#include "tools/internal/fio.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "tools/internal/process.h"

namespace optstate::tools {

bool FioAvailable() { return InPath("fio"); }

Result<FioResult> RunFio(const std::vector<FioJob>& jobs) {
  if (!FioAvailable()) return NotFound("fio is not installed (apt-get install fio)");
  // fio's I/O buffers come from malloc; glibc.malloc.hugetlb=1 (glibc >= 2.35)
  // backs them with transparent huge pages (vfs/io_buffer.h says what that
  // changes): faster on some disks, never slower, and a baseline is the best
  // fio can do.
  std::vector<std::string> argv = {"env", "GLIBC_TUNABLES=glibc.malloc.hugetlb=1",
                                   "fio", "--output-format=json", "--ioengine=io_uring",
                                   "--direct=1", "--thread", "--group_reporting=0"};
  for (const FioJob& j : jobs) {
    argv.push_back("--name=" + j.name);
    argv.push_back("--filename=" + j.filename);
    argv.push_back("--rw=" + j.rw);
    argv.push_back(fmt::format("--bs={}", j.block_size_bytes));
    argv.push_back(fmt::format("--iodepth={}", j.iodepth));
    argv.push_back(fmt::format("--size={}", j.size_bytes));
    if (j.offset_bytes) argv.push_back(fmt::format("--offset={}", j.offset_bytes));
    if (j.rw == "rw" || j.rw == "randrw" || j.rw == "readwrite") {
      argv.push_back(fmt::format("--rwmixread={}", j.rwmixread));
    }
    if (j.end_fsync) argv.push_back("--end_fsync=1");
    if (j.stonewall) argv.push_back("--stonewall");
    for (const auto& [k, v] : j.extra) argv.push_back("--" + k + "=" + v);
  }
  OPTSTATE_ASSIGN_OR_RETURN(CommandResult r, RunCommand(argv));
  if (r.exit_code != 0) {
    return IoError(fmt::format("fio failed (exit {}): {}: {}", r.exit_code, JoinCommand(argv),
                               r.err.substr(0, 2000)));
  }
  // fio may print warnings before the JSON document.
  size_t brace = r.out.find('{');
  if (brace == std::string::npos) {
    return IoError(fmt::format("fio printed no JSON: {}", r.out.substr(0, 500)));
  }
  nlohmann::json doc = nlohmann::json::parse(r.out.substr(brace), nullptr, false);
  if (doc.is_discarded() || !doc.contains("jobs")) {
    return IoError(fmt::format("cannot parse fio JSON output: {}", r.out.substr(0, 500)));
  }
  FioResult res;
  res.version = doc.value("fio version", "");
  for (const auto& j : doc["jobs"]) {
    FioJobResult jr;
    jr.name = j.value("jobname", "");
    if (j.value("error", 0) != 0) {
      return IoError(fmt::format("fio job {} reported error {}", jr.name, j.value("error", 0)));
    }
    jr.read_bytes = j["read"].value("io_bytes", uint64_t{0});
    jr.write_bytes = j["write"].value("io_bytes", uint64_t{0});
    jr.runtime_seconds = static_cast<double>(j.value("job_runtime", uint64_t{0})) / 1e3;
    res.jobs.push_back(std::move(jr));
  }
  return res;
}

}  // namespace optstate::tools
