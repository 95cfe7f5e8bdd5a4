// Tests of both IoEngines (io_uring and sync) on real files: round trips,
// 1000 random requests at queue depth 32 checked against an in-memory model
// and an independent pread of the file, faked io_uring completions, errors.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tests/common/test_util.h"
#include "tests/vfs/io_test_util.h"
#include "vfs/file_system.h"
#include "vfs/internal/posix_file.h"
#include "vfs/internal/uring_io_engine.h"
#include "vfs/io_engine.h"

namespace optstate::vfs {
namespace {

using testing::AlignedBuf;
using testing::AllocAligned;
using testing::FillPattern;
using testing::TempDir;

enum class Where { kDiskDirect, kDiskBuffered, kShmFallback };
struct EngineParam {
  bool uring;
  Where where;
  uint64_t max_sqe = 0;  // IoEngineOptions::max_sqe_bytes
};

std::string ParamName(const ::testing::TestParamInfo<EngineParam>& info) {
  std::string s = info.param.uring ? (info.param.max_sqe > 0 ? "UringSplit" : "Uring") : "Sync";
  switch (info.param.where) {
    case Where::kDiskDirect: return s + "DiskDirect";
    case Where::kDiskBuffered: return s + "DiskBuffered";
    case Where::kShmFallback: return s + "ShmFallback";
  }
  return s;
}

// Reads the whole file with plain pread on a fresh descriptor: the reference
// that owes nothing to the code under test.
std::vector<char> ReadWithPread(const std::string& path, size_t len) {
  std::vector<char> out(len);
  int fd = ::open(path.c_str(), O_RDONLY);
  EXPECT_GE(fd, 0) << path;
  size_t done = 0;
  while (done < len) {
    ssize_t n = ::pread(fd, out.data() + done, len - done, done);
    EXPECT_GT(n, 0) << "pread " << path << " at " << done;
    if (n <= 0) break;
    done += n;
  }
  ::close(fd);
  return out;
}

class IoEngineTest : public ::testing::TestWithParam<EngineParam> {
 protected:
  void SetUp() override {
    const EngineParam p = GetParam();
    dir_ = std::make_unique<TempDir>(p.where == Where::kShmFallback ? "/dev/shm" : TempDir::DefaultBase());
    path_ = dir_->Sub("data");
    if (p.where == Where::kShmFallback) internal::SetDirectRefusedForTesting(true);
    auto f = FileSystem::Default()->Open(
        path_, OpenOptions{.create = true, .direct = p.where != Where::kDiskBuffered});
    internal::SetDirectRefusedForTesting(false);
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    file_ = std::move(*f);
    if (p.where == Where::kDiskDirect && !file_->direct()) {
      GTEST_SKIP() << "the filesystem of " << path_ << " refuses O_DIRECT";
    }
    if (p.where == Where::kShmFallback) {
      EXPECT_FALSE(file_->direct());
      EXPECT_EQ(internal::DirectFallbackWarningCount(), 1u);
    }
    ASSERT_TRUE(file_->Fallocate(0, kFileBytes).ok());
    arena_ = AllocAligned(kArenaBytes);
  }

  std::unique_ptr<IoEngine> MakeEngine(uint32_t qd, bool register_half_arena) {
    if (GetParam().uring) {
      IoEngineOptions o;
      o.queue_depth = qd;
      o.max_sqe_bytes = GetParam().max_sqe;
      if (register_half_arena) o.registered_buffers.push_back({arena_.get(), kArenaBytes / 2});
      auto e = IoEngine::NewUring(o);
      EXPECT_TRUE(e.ok()) << e.status().ToString();
      return e.ok() ? std::move(*e) : nullptr;
    }
    auto e = IoEngine::NewSync(1 << 20);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    return e.ok() ? std::move(*e) : nullptr;
  }

  static constexpr uint64_t kFileBytes = 16ull << 20;
  static constexpr uint64_t kSlotBytes = 256 << 10;
  static constexpr uint64_t kSlots = 64;
  static constexpr uint64_t kArenaBytes = kSlots * kSlotBytes;

  std::unique_ptr<TempDir> dir_;
  std::string path_;
  std::unique_ptr<File> file_;
  AlignedBuf arena_;
};

TEST_P(IoEngineTest, WriteThenReadRoundTrip) {
  auto engine = MakeEngine(8, true);
  ASSERT_NE(engine, nullptr);
  EXPECT_STREQ(engine->name(), GetParam().uring ? "io_uring" : "sync");
  // 8 writes of 1 MiB + 1 of 3 MiB (larger than the sync engine's staging).
  std::vector<char> model(kFileBytes, 0);
  AlignedBuf big = AllocAligned(3 << 20);
  FillPattern(big.get(), 3 << 20, 7);
  std::vector<IoRequest> reqs;
  for (uint64_t i = 0; i < 8; ++i) {
    std::byte* b = arena_.get() + i * (1 << 20);
    FillPattern(b, 1 << 20, 100 + i);
    reqs.push_back({IoRequest::Op::kWrite, file_.get(), i * (1 << 20), 1 << 20, b, i});
    std::memcpy(model.data() + i * (1 << 20), b, 1 << 20);
  }
  reqs.push_back({IoRequest::Op::kWrite, file_.get(), 12 << 20, 3 << 20, big.get(), 99});
  std::memcpy(model.data() + (12 << 20), big.get(), 3 << 20);
  ASSERT_TRUE(engine->Submit(reqs).ok());
  std::vector<IoCompletion> done;
  ASSERT_TRUE(engine->Reap(&done, reqs.size()).ok());
  ASSERT_EQ(done.size(), reqs.size());
  std::set<uint64_t> tags;
  for (const auto& c : done) {
    EXPECT_TRUE(c.status.ok()) << c.status.ToString();
    tags.insert(c.tag);
  }
  EXPECT_EQ(tags.size(), reqs.size());
  EXPECT_EQ(engine->in_flight(), 0u);
  EXPECT_EQ(ReadWithPread(path_, kFileBytes), model);

  // Read back through the engine into zeroed buffers.
  std::memset(arena_.get(), 0, kArenaBytes);
  AlignedBuf big_back = AllocAligned(3 << 20);
  reqs.clear();
  for (uint64_t i = 0; i < 8; ++i) {
    reqs.push_back({IoRequest::Op::kRead, file_.get(), i * (1 << 20), 1 << 20, arena_.get() + i * (1 << 20), i});
  }
  reqs.push_back({IoRequest::Op::kRead, file_.get(), 12 << 20, 3 << 20, big_back.get(), 99});
  ASSERT_TRUE(engine->Submit(reqs).ok());
  done.clear();
  ASSERT_TRUE(engine->Reap(&done, reqs.size()).ok());
  ASSERT_EQ(done.size(), reqs.size());
  for (const auto& c : done) EXPECT_TRUE(c.status.ok()) << c.status.ToString();
  EXPECT_EQ(std::memcmp(arena_.get(), model.data(), 8 << 20), 0);
  EXPECT_EQ(std::memcmp(big_back.get(), model.data() + (12 << 20), 3 << 20), 0);
  if (auto* uring = dynamic_cast<internal::UringIoEngine*>(engine.get())) {
    // The 16 arena requests lie in the registered half: fixed opcodes; the
    // two 3 MiB requests use a plain buffer.
    const auto& st = uring->stats();
    EXPECT_EQ(st.requests, 18u);
    // Split (max_sqe 16 KiB): every request here is > 16 parts of 16 KiB, so
    // it goes out as exactly 16 parallel SQEs.
    EXPECT_EQ(st.sqes - st.resubmissions, GetParam().max_sqe > 0 ? 18u * 16 : 18u);
    EXPECT_GE(st.fixed_buffer_sqes, 16u);
    EXPECT_LT(st.fixed_buffer_sqes, st.sqes);
    if (uring->registered_files_active()) {
      EXPECT_EQ(st.fixed_file_sqes, st.sqes);
    }
  }
}

// 1000 random reads and writes, up to 64 outstanding at queue depth 32, mixed
// registered and unregistered buffers; no two outstanding requests overlap.
// Every read is checked against an in-memory model, the final file against an
// independent pread.
TEST_P(IoEngineTest, ThousandRandomRequestsMatchModel) {
  auto engine = MakeEngine(32, true);
  ASSERT_NE(engine, nullptr);
  std::vector<char> model(kFileBytes, 0);
  std::mt19937_64 rng(12345);
  struct Pending {
    IoRequest req;
    std::vector<char> expect;  // for reads
    uint64_t slot;
  };
  std::map<uint64_t, Pending> pending;
  std::vector<uint64_t> free_slots;
  for (uint64_t s = 0; s < kSlots; ++s) free_slots.push_back(s);
  const bool direct = file_->direct();
  auto overlaps = [&](uint64_t off, uint64_t len) {
    for (const auto& [tag, p] : pending) {
      if (off < p.req.offset + p.req.length && p.req.offset < off + len) return true;
    }
    return false;
  };
  uint64_t issued = 0, completed = 0, reads_checked = 0;
  auto reap = [&](size_t min) {
    std::vector<IoCompletion> done;
    ASSERT_TRUE(engine->Reap(&done, min).ok());
    ASSERT_GE(done.size(), std::min(min, pending.size()));
    for (const auto& c : done) {
      auto it = pending.find(c.tag);
      ASSERT_NE(it, pending.end()) << "unknown tag " << c.tag;
      ASSERT_TRUE(c.status.ok()) << c.status.ToString();
      const Pending& p = it->second;
      if (p.req.op == IoRequest::Op::kRead) {
        ASSERT_EQ(std::memcmp(p.req.buf, p.expect.data(), p.req.length), 0)
            << "read tag " << c.tag << " offset " << p.req.offset << " length " << p.req.length;
        ++reads_checked;
      }
      free_slots.push_back(p.slot);
      pending.erase(it);
      ++completed;
    }
  };
  while (issued < 1000) {
    std::vector<IoRequest> batch;
    int want = 1 + static_cast<int>(rng() % 12);
    for (int i = 0; i < want && issued < 1000 && !free_slots.empty(); ++i) {
      uint64_t len = direct ? 4096 * (1 + rng() % 64) : 1 + rng() % kSlotBytes;
      uint64_t off = direct ? 4096 * (rng() % ((kFileBytes - len) / 4096)) : rng() % (kFileBytes - len);
      if (overlaps(off, len)) continue;
      std::swap(free_slots[rng() % free_slots.size()], free_slots.back());  // any slot, either half
      uint64_t slot = free_slots.back();
      free_slots.pop_back();
      std::byte* buf = arena_.get() + slot * kSlotBytes;
      Pending p;
      p.slot = slot;
      p.req = IoRequest{rng() % 2 ? IoRequest::Op::kRead : IoRequest::Op::kWrite, file_.get(), off, len, buf,
                        issued};
      if (p.req.op == IoRequest::Op::kWrite) {
        FillPattern(buf, len, rng());
        std::memcpy(model.data() + off, buf, len);
      } else {
        std::memset(buf, 0xee, len);
        p.expect.assign(model.begin() + off, model.begin() + off + len);
      }
      batch.push_back(p.req);
      pending.emplace(issued, std::move(p));
      ++issued;
    }
    ASSERT_TRUE(engine->Submit(batch).ok());
    EXPECT_EQ(engine->in_flight(), pending.size());
    size_t min = rng() % 3 == 0 ? 0 : rng() % (pending.size() + 1);
    reap(min);
    if (::testing::Test::HasFatalFailure()) return;
  }
  reap(pending.size());
  EXPECT_EQ(completed, 1000u);
  EXPECT_GT(reads_checked, 300u);
  EXPECT_EQ(engine->in_flight(), 0u);
  EXPECT_EQ(ReadWithPread(path_, kFileBytes), model);
  if (auto* uring = dynamic_cast<internal::UringIoEngine*>(engine.get())) {
    const auto& st = uring->stats();
    EXPECT_EQ(st.requests, 1000u);
    EXPECT_GT(st.fixed_buffer_sqes, 200u);  // slots in the registered half
    EXPECT_LT(st.fixed_buffer_sqes, st.sqes - 200);
  }
}

TEST_P(IoEngineTest, MoreRequestsThanQueueDepthInOneSubmit) {
  auto engine = MakeEngine(1, false);
  ASSERT_NE(engine, nullptr);
  std::vector<IoRequest> reqs;
  for (uint64_t i = 0; i < 20; ++i) {
    std::byte* b = arena_.get() + i * 4096;
    FillPattern(b, 4096, i);
    reqs.push_back({IoRequest::Op::kWrite, file_.get(), (i * 7 % 20) * 4096, 4096, b, i});
  }
  ASSERT_TRUE(engine->Submit(reqs).ok());
  EXPECT_EQ(engine->in_flight(), 20u);
  std::vector<IoCompletion> done;
  ASSERT_TRUE(engine->Reap(&done, 0).ok());  // what is ready, no wait
  ASSERT_TRUE(engine->Reap(&done, 100).ok());  // asks more than in flight: all
  ASSERT_EQ(done.size(), 20u);
  std::vector<char> file = ReadWithPread(path_, 20 * 4096);
  for (uint64_t i = 0; i < 20; ++i) {
    EXPECT_EQ(std::memcmp(file.data() + (i * 7 % 20) * 4096, arena_.get() + i * 4096, 4096), 0) << i;
  }
}

TEST_P(IoEngineTest, ReadPastEndOfFileFailsWithoutHanging) {
  auto engine = MakeEngine(4, false);
  ASSERT_NE(engine, nullptr);
  IoRequest r{IoRequest::Op::kRead, file_.get(), kFileBytes, 8192, arena_.get(), 5};
  ASSERT_TRUE(engine->Submit({&r, 1}).ok());
  std::vector<IoCompletion> done;
  ASSERT_TRUE(engine->Reap(&done, 1).ok());
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].tag, 5u);
  ASSERT_FALSE(done[0].status.ok());
  EXPECT_NE(done[0].status.message().find(path_), std::string::npos) << done[0].status.ToString();
  EXPECT_NE(done[0].status.message().find("offset " + std::to_string(kFileBytes)), std::string::npos)
      << done[0].status.ToString();
}

TEST_P(IoEngineTest, InvalidRequestsFailAtOnce) {
  auto engine = MakeEngine(4, false);
  ASSERT_NE(engine, nullptr);
  IoRequest null_file{IoRequest::Op::kRead, nullptr, 0, 4096, arena_.get(), 1};
  EXPECT_EQ(engine->Submit({&null_file, 1}).code(), StatusCode::kInvalidArgument);
  if (file_->direct()) {
    IoRequest misaligned{IoRequest::Op::kWrite, file_.get(), 100, 4096, arena_.get(), 2};
    Status s = engine->Submit({&misaligned, 1});
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find(path_), std::string::npos) << s.ToString();
  }
  EXPECT_EQ(engine->in_flight(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Engines, IoEngineTest,
                         ::testing::Values(EngineParam{true, Where::kDiskDirect},
                                           EngineParam{true, Where::kDiskBuffered},
                                           EngineParam{true, Where::kShmFallback},
                                           EngineParam{true, Where::kDiskDirect, 16 << 10},
                                           EngineParam{true, Where::kDiskBuffered, 16 << 10},
                                           EngineParam{false, Where::kDiskDirect},
                                           EngineParam{false, Where::kShmFallback}),
                         ParamName);

// ---- io_uring specifics: faked completions, registered files ----

class UringFaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = dir_.Sub("f");
    auto f = FileSystem::Default()->Open(path_, OpenOptions{.create = true, .direct = true});
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    file_ = std::move(*f);
    ASSERT_TRUE(file_->Fallocate(0, kBytes).ok());
    buf_ = AllocAligned(kBytes);
    back_ = AllocAligned(kBytes);
  }

  // Writes then reads kBytes in 16 requests of 64 KiB through an engine whose
  // completions pass through `fault`; returns the statuses by tag.
  std::map<uint64_t, Status> RunWithFault(IoEngineOptions::CompletionFault fault, bool registered,
                                          uint64_t max_sqe = 0) {
    IoEngineOptions o;
    o.queue_depth = 8;
    o.max_sqe_bytes = max_sqe;
    o.completion_fault = std::move(fault);
    if (registered) {
      o.registered_buffers.push_back({buf_.get(), kBytes});
      o.registered_buffers.push_back({back_.get(), kBytes});
    }
    auto e = IoEngine::NewUring(o);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    std::map<uint64_t, Status> out;
    if (!e.ok()) return out;
    FillPattern(buf_.get(), kBytes, 77);
    std::memset(back_.get(), 0, kBytes);
    for (auto op : {IoRequest::Op::kWrite, IoRequest::Op::kRead}) {
      std::vector<IoRequest> reqs;
      for (uint64_t i = 0; i < 16; ++i) {
        std::byte* b = (op == IoRequest::Op::kWrite ? buf_.get() : back_.get()) + i * kReq;
        reqs.push_back({op, file_.get(), i * kReq, kReq, b, (op == IoRequest::Op::kRead ? 100 : 0) + i});
      }
      EXPECT_TRUE((*e)->Submit(reqs).ok());
      std::vector<IoCompletion> done;
      EXPECT_TRUE((*e)->Reap(&done, reqs.size()).ok());
      EXPECT_EQ(done.size(), reqs.size());
      for (auto& c : done) out[c.tag] = c.status;
    }
    return out;
  }

  static constexpr uint64_t kBytes = 1 << 20;
  static constexpr uint64_t kReq = 64 << 10;
  TempDir dir_;
  std::string path_;
  std::unique_ptr<File> file_;
  AlignedBuf buf_, back_;
};

// Fakes `res` on the first completion of every request and counts the calls.
struct FirstCompletionFault {
  int32_t fake;  // > 0: a short count in bytes; otherwise a result code
  int* calls;
  int* faked;
  std::set<uint64_t>* seen;
  int32_t operator()(const IoRequest& r, uint64_t, uint32_t, int32_t res) const {
    ++*calls;
    if (seen->insert(r.tag).second) {
      ++*faked;
      return fake;
    }
    return res;
  }
};

TEST_F(UringFaultTest, RetryableFakedCompletionsAreResubmitted) {
  struct Case {
    const char* name;
    int32_t fake;
  };
  for (const Case& c : {Case{"short 4096", 4096}, Case{"short 12288", 12288}, Case{"short 100 (mid-block)", 100},
                        Case{"zero bytes", 0}, Case{"-EAGAIN", -EAGAIN}, Case{"-EINTR", -EINTR}}) {
    for (bool registered : {false, true}) {
      SCOPED_TRACE(std::string(c.name) + (registered ? " registered" : " plain"));
      int calls = 0, faked = 0;
      std::set<uint64_t> seen;
      auto statuses = RunWithFault(FirstCompletionFault{c.fake, &calls, &faked, &seen}, registered);
      ASSERT_EQ(statuses.size(), 32u);
      for (auto& [tag, s] : statuses) EXPECT_TRUE(s.ok()) << "tag " << tag << ": " << s.ToString();
      EXPECT_EQ(faked, 32);
      EXPECT_GE(calls, 64);  // every request needed a second SQE
      EXPECT_EQ(std::memcmp(buf_.get(), back_.get(), kBytes), 0);
      EXPECT_EQ(ReadWithPread(path_, kBytes), std::vector<char>(reinterpret_cast<char*>(buf_.get()),
                                                                reinterpret_cast<char*>(buf_.get()) + kBytes));
    }
  }
}

TEST_F(UringFaultTest, EioCompletionNamesFileOffsetAndErrno) {
  int calls = 0;
  auto statuses = RunWithFault(
      [&calls](const IoRequest& r, uint64_t, uint32_t, int32_t res) {
        ++calls;
        return r.tag == 3 || r.tag == 105 ? -EIO : res;
      },
      true);
  ASSERT_EQ(statuses.size(), 32u);
  for (auto& [tag, s] : statuses) {
    if (tag == 3 || tag == 105) {
      ASSERT_FALSE(s.ok()) << tag;
      EXPECT_EQ(s.err(), EIO);
      EXPECT_EQ(s.code(), StatusCode::kIoError);
      uint64_t off = (tag % 100) * kReq;
      EXPECT_NE(s.message().find(path_), std::string::npos) << s.ToString();
      EXPECT_NE(s.message().find("offset " + std::to_string(off) + " "), std::string::npos) << s.ToString();
      EXPECT_NE(s.message().find(std::strerror(EIO)), std::string::npos) << s.ToString();
      EXPECT_NE(s.message().find(tag == 3 ? "write" : "read"), std::string::npos) << s.ToString();
    } else {
      EXPECT_TRUE(s.ok()) << tag << ": " << s.ToString();
    }
  }
  EXPECT_EQ(calls, 32);  // -EIO is not retried
}

// max_sqe_bytes: a request in parallel parts completes once; a part's short
// transfer is resubmitted on its own; a part's error fails only its request,
// naming the part's offset; every other byte lands.
TEST_F(UringFaultTest, SplitRequestsCompleteOnceAndFailAlone) {
  constexpr uint64_t kPart = 16 << 10;  // 4 parts per 64 KiB request
  {
    int calls = 0, faked = 0;
    std::set<uint64_t> seen;
    auto statuses = RunWithFault(FirstCompletionFault{4096, &calls, &faked, &seen}, true, kPart);
    ASSERT_EQ(statuses.size(), 32u);
    for (auto& [tag, s] : statuses) EXPECT_TRUE(s.ok()) << "tag " << tag << ": " << s.ToString();
    EXPECT_EQ(calls, 32 * 4 + faked);  // one SQE per part, one more per short part
    EXPECT_EQ(std::memcmp(buf_.get(), back_.get(), kBytes), 0);
  }
  const uint64_t bad = 3 * kReq + 2 * kPart;  // the third part of write tag 3
  int calls = 0;
  auto statuses = RunWithFault(
      [&calls, bad](const IoRequest& r, uint64_t off, uint32_t, int32_t res) {
        ++calls;
        return r.op == IoRequest::Op::kWrite && off == bad ? -EIO : res;
      },
      true, kPart);
  ASSERT_EQ(statuses.size(), 32u);
  EXPECT_EQ(calls, 32 * 4);
  for (auto& [tag, s] : statuses) {
    if (tag == 3) {
      ASSERT_FALSE(s.ok());
      EXPECT_EQ(s.err(), EIO);
      EXPECT_NE(s.message().find("offset " + std::to_string(bad) + " "), std::string::npos) << s.ToString();
    } else {
      EXPECT_TRUE(s.ok()) << tag << ": " << s.ToString();
    }
  }
  std::vector<char> disk = ReadWithPread(path_, kBytes);
  const char* want = reinterpret_cast<const char*>(buf_.get());
  EXPECT_EQ(std::memcmp(disk.data(), want, bad), 0);
  EXPECT_EQ(std::memcmp(disk.data() + bad + kPart, want + bad + kPart, kBytes - bad - kPart), 0);
}

TEST_F(UringFaultTest, PersistentZeroOrEagainEndsInAnErrorNotALoop) {
  for (int32_t fake : {0, -EAGAIN}) {
    SCOPED_TRACE(fake);
    int calls = 0;
    auto statuses = RunWithFault(
        [&calls, fake](const IoRequest& r, uint64_t, uint32_t, int32_t res) {
          ++calls;
          return r.tag == 101 ? fake : res;
        },
        false);
    ASSERT_EQ(statuses.size(), 32u);
    EXPECT_FALSE(statuses[101].ok());
    EXPECT_NE(statuses[101].message().find(path_), std::string::npos) << statuses[101].ToString();
    if (fake == -EAGAIN) {
      EXPECT_EQ(statuses[101].err(), EAGAIN);
    }
    for (auto& [tag, s] : statuses) {
      if (tag != 101) {
        EXPECT_TRUE(s.ok()) << tag;
      }
    }
    EXPECT_LT(calls, 32 + 2000);
  }
}

// A registered-file slot must follow the file, not the fd number: after a
// close, the same fd number names another file.
TEST(UringRegisteredFilesTest, FdReuseGoesToTheNewFile) {
  TempDir dir;
  IoEngineOptions o;
  o.queue_depth = 4;
  auto e = IoEngine::NewUring(o);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  auto* uring = dynamic_cast<internal::UringIoEngine*>(e->get());
  ASSERT_NE(uring, nullptr);
  AlignedBuf b = AllocAligned(4096);
  std::vector<std::string> paths;
  int first_fd = -1;
  for (int i = 0; i < 3; ++i) {
    paths.push_back(dir.Sub("f" + std::to_string(i)));
    auto f = FileSystem::Default()->Open(paths.back(), OpenOptions{.create = true});
    ASSERT_TRUE(f.ok());
    if (i == 0) first_fd = (*f)->fd();
    EXPECT_EQ((*f)->fd(), first_fd);  // the kernel reuses the lowest free fd
    std::memset(b.get(), 'a' + i, 4096);
    IoRequest r{IoRequest::Op::kWrite, f->get(), 0, 4096, b.get(), static_cast<uint64_t>(i)};
    ASSERT_TRUE((*e)->Submit({&r, 1}).ok());
    std::vector<IoCompletion> done;
    ASSERT_TRUE((*e)->Reap(&done, 1).ok());
    ASSERT_EQ(done.size(), 1u);
    ASSERT_TRUE(done[0].status.ok()) << done[0].status.ToString();
  }
  for (int i = 0; i < 3; ++i) {
    std::vector<char> got = ReadWithPread(paths[i], 4096);
    EXPECT_EQ(got, std::vector<char>(4096, static_cast<char>('a' + i))) << paths[i];
  }
  if (!uring->registered_files_active()) GTEST_SKIP() << "kernel without sparse registered files";
}

TEST(UringOptionsTest, SqpollRoundTrip) {
  TempDir dir;
  auto f = FileSystem::Default()->Open(dir.Sub("f"), OpenOptions{.create = true, .direct = true});
  ASSERT_TRUE(f.ok());
  IoEngineOptions o;
  o.queue_depth = 8;
  o.sqpoll = true;
  auto e = IoEngine::NewUring(o);
  if (!e.ok()) GTEST_SKIP() << "SQPOLL unavailable here: " << e.status().ToString();
  constexpr uint64_t kN = 64, kLen = 16 << 10;
  AlignedBuf buf = AllocAligned(kN * kLen), back = AllocAligned(kN * kLen);
  FillPattern(buf.get(), kN * kLen, 42);
  for (auto op : {IoRequest::Op::kWrite, IoRequest::Op::kRead}) {
    std::vector<IoRequest> reqs;
    for (uint64_t i = 0; i < kN; ++i) {
      std::byte* b = (op == IoRequest::Op::kWrite ? buf.get() : back.get()) + i * kLen;
      reqs.push_back({op, f->get(), i * kLen, kLen, b, i});
    }
    ASSERT_TRUE((*e)->Submit(reqs).ok());
    std::vector<IoCompletion> done;
    ASSERT_TRUE((*e)->Reap(&done, kN).ok());
    ASSERT_EQ(done.size(), kN);
    for (const auto& c : done) EXPECT_TRUE(c.status.ok()) << c.status.ToString();
  }
  EXPECT_EQ(std::memcmp(buf.get(), back.get(), kN * kLen), 0);
}

// Wake() from another thread ends a Reap that waits for a read nothing will
// complete (a FIFO with no data), and a Wake() before Reap makes that Reap
// return at once; the read itself stays in flight and completes later.
TEST(UringOptionsTest, WakeEndsABlockedReapEarly) {
  TempDir dir;
  const std::string path = dir.Sub("fifo");
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0) << std::strerror(errno);
  auto f = FileSystem::Default()->Open(path, OpenOptions{});  // O_RDWR: no writer needed
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  IoEngineOptions o;
  o.queue_depth = 4;
  o.wakeable = true;
  auto e = IoEngine::NewUring(o);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  AlignedBuf b = AllocAligned(4096);
  IoRequest r{IoRequest::Op::kRead, f->get(), 0, 4096, b.get(), 7};
  ASSERT_TRUE((*e)->Submit({&r, 1}).ok());

  // Without a working Wake() the Reap below would wait for data forever: after
  // test_util::kHangLimit this thread supplies it, so the test fails instead
  // of hanging. The pause before Wake() lets the Reap block first on most
  // runs; where the Wake() comes first, the Reap must return at once as well.
  const std::vector<char> data(4096, 'x');
  std::mutex mu;
  std::condition_variable cv;
  bool reaped = false;  // guarded by mu
  std::atomic<bool> fed{false};
  std::thread waker([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    (*e)->Wake();
    std::unique_lock<std::mutex> l(mu);
    if (!cv.wait_for(l, test_util::kHangLimit, [&] { return reaped; }) &&
        ::write((*f)->fd(), data.data(), data.size()) == static_cast<ssize_t>(data.size())) {
      fed = true;
    }
  });
  std::vector<IoCompletion> done;
  Status st = (*e)->Reap(&done, 1);
  {
    std::lock_guard<std::mutex> l(mu);
    reaped = true;
  }
  cv.notify_all();
  waker.join();
  ASSERT_TRUE(st.ok()) << st.ToString();
  ASSERT_FALSE(fed.load()) << "Reap waited for the data instead of returning on Wake()";
  EXPECT_TRUE(done.empty());
  EXPECT_EQ((*e)->in_flight(), 1u);

  (*e)->Wake();
  ASSERT_TRUE((*e)->Reap(&done, 1).ok());
  EXPECT_TRUE(done.empty()) << "a Wake() before Reap must make it return at once";

  ASSERT_EQ(::write((*f)->fd(), data.data(), data.size()), static_cast<ssize_t>(data.size()));
  ASSERT_TRUE((*e)->Reap(&done, 1).ok());
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].tag, 7u);
  EXPECT_TRUE(done[0].status.ok()) << done[0].status.ToString();
  EXPECT_EQ(std::memcmp(b.get(), data.data(), data.size()), 0);
  EXPECT_EQ((*e)->in_flight(), 0u);
}

TEST(UringOptionsTest, RejectsBadQueueDepth) {
  IoEngineOptions o;
  o.queue_depth = 0;
  EXPECT_EQ(IoEngine::NewUring(o).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(IoEngine::NewSync(0).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace optstate::vfs
