// ChunkReader without FUSE: many threads reading one open file at once (what
// the kernel does for parallel preads or AIO on one descriptor) against the
// bytes the library reads (CheckpointLayout::Read, independent of the
// reader's window and slots).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <random>
#include <thread>

#include <fmt/format.h>

#include "mount/cache_pusher.h"
#include "mount/chunk_reader.h"
#include "mount/prefetcher.h"
#include "mount/store_tree.h"
#include "tests/common/test_util.h"
#include "tests/vfs/checkpoint_test_util.h"
#include "base/sync_point.h"

namespace optstate::mount {
namespace {

using namespace vfs;           // NOLINT
using namespace vfs::testing;  // NOLINT
using test_util::kHangLimit;
using test_util::WaitFor;

class ChunkReaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = MakeTempDir("chunk_reader_test");
    auto s = CreateStore(root_ + "/s");  // 2 MiB chunks
    ASSERT_NE(s, nullptr);
    CreateTensors(s.get(), {{"big", 8ull << 20, {}}});  // 32 MiB per field: 16 chunks
    WriteStep(s.get(), 1);
    MountOptions o;
    o.store_root = root_;
    tree_ = std::make_unique<StoreTree>(o);
    auto n = tree_->Resolve("/s/latest/tensors/big/main");
    ASSERT_TRUE(n.ok()) << n.status().ToString();
    node_ = *n;
    want_.resize(node_.file->size_bytes);
    ASSERT_TRUE(node_.gen->layout->Read(*node_.file, 0, want_.data(), want_.size()).ok());
  }
  void TearDown() override {
    tree_.reset();
    std::filesystem::remove_all(root_);
  }

  // Reader options: `readahead_chunks` chunks ahead, one SQE per chunk.
  MountOptions Reading(uint32_t readahead_chunks) const {
    MountOptions o = tree_->options();
    o.readahead_chunks = readahead_chunks;
    return o;
  }

  std::string root_;
  std::unique_ptr<StoreTree> tree_;
  Node node_;
  std::string want_;
};

// Readers that want different chunks at once: one asks for a chunk nobody has
// loaded, another at once for one already loaded (which moves the read-ahead
// window away from the first). Every read must finish with the library's
// bytes; a reader left waiting for a chunk the I/O thread no longer means to
// load hangs here, so a watchdog fails the test instead of hanging CI.
// kThreads threads read `reads` ranges each of r's file at once, against
// `want` (its bytes, from the library): half stay within its first `near`
// bytes (chunks the window keeps loaded), half jump anywhere (chunks it must
// load); every other read through ReadWith, which pins two chunks at once
// across a boundary when the second is ready. Returns the reads that failed
// or returned other bytes. A reader left waiting for a chunk the I/O thread
// no longer means to load would hang: a watchdog ends the process instead.
uint64_t ConcurrentReads(ChunkReader* r, const std::string& want, uint64_t near, int reads) {
  const uint64_t size = want.size();
  constexpr int kThreads = 6;
  std::atomic<uint64_t> done{0}, bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(1000 + t);
      std::string got;
      for (int i = 0; i < reads; ++i) {
        const uint64_t span = t % 2 == 0 ? std::min(near, size) : size;
        const uint64_t off = rng() % span;
        const uint64_t len = std::min<uint64_t>(1 + rng() % (256 << 10), size - off);
        got.assign(len, '\0');
        Result<uint64_t> n = 0;
        if (i % 2 == 0) {
          n = r->Read(off, len, got.data());
        } else {
          got.clear();
          n = r->ReadWith(off, len, [&](std::span<const iovec> iov) {
            for (const iovec& v : iov) got.append(static_cast<const char*>(v.iov_base), v.iov_len);
            return Status();
          });
        }
        if (!n.ok() || *n != len || got.size() != len || got.compare(0, len, want, off, len) != 0) ++bad;
        ++done;
      }
    });
  }
  uint64_t last = 0;
  auto last_change = std::chrono::steady_clock::now();
  while (done.load() < uint64_t{kThreads} * reads) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (done.load() != last) {
      last = done.load();
      last_change = std::chrono::steady_clock::now();
    } else if (std::chrono::steady_clock::now() - last_change > kHangLimit) {
      std::fprintf(stderr, "FAILED: reads stalled for %lld s after %llu of %d: a reader waits for a chunk "
                   "that is never loaded\n", static_cast<long long>(kHangLimit.count() / 1000),
                   static_cast<unsigned long long>(last), kThreads * reads);
      std::fflush(stderr);
      std::_Exit(1);  // the stuck threads cannot be joined
    }
  }
  for (auto& th : threads) th.join();
  return bad.load();
}

// Readers that want different chunks at once: one asks for a chunk nobody has
// loaded, another at once for one already loaded (which moves the read-ahead
// window away from the first). Every read must finish with the library's
// bytes (with 3 slots and 6 threads, ReadWith must never wait while holding a pin).
TEST_F(ChunkReaderTest, ConcurrentReadersOnOneFileAllFinishWithTheLibrarysBytes) {
  ChunkBufferPool pool(1ull << 30);
  auto r = ChunkReader::Open(node_.gen, node_.file, Reading(2), &pool);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(ConcurrentReads(r->get(), want_, 3 * (2ull << 20), 400), 0u);
}

// One sequential stream served by several threads at once, as the kernel's
// read-ahead through the page cache is (background 1 MiB requests, issued in
// order, taken by up to 16 worker threads) or a loader's concurrent preads:
// kThreads threads take the next 1 MiB of the file from a shared counter and
// read it after a random pause, so requests reach the reader out of order,
// up to kThreads - 1 MiB behind the newest (a thread takes a block only once
// every block kThreads or more before it is done, as the kernel's bounded
// read-ahead does: a thread the scheduler stalls holds the others back instead
// of letting them run past the trail). A late request must neither move the
// window back nor find its chunk evicted: every chunk is loaded once.
// (Before the trail, each late request was a backward jump; the window
// snapped back and read-ahead evicted the chunks those requests came for:
// 1.4-2.5 loads per chunk through the page cache on both machines.)
TEST_F(ChunkReaderTest, ParallelRequestsOfOneStreamLoadEachChunkOnce) {
  ReadStats stats;
  ChunkBufferPool pool(1ull << 30);
  // Two chunks ahead: a window that late requests could easily push out.
  auto r = ChunkReader::Open(node_.gen, node_.file, Reading(2), &pool, &stats);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  constexpr uint64_t kReq = 1ull << 20;
  constexpr int kThreads = 4;  // spread <= 3 MiB: within the trail of 2 MiB chunks
  const uint64_t blocks = want_.size() / kReq;
  ASSERT_EQ(want_.size() % kReq, 0u);
  std::atomic<uint64_t> bad{0};
  std::mutex mu;
  std::condition_variable cv;
  uint64_t next = 0;                            // guarded by mu
  std::vector<bool> finished(blocks, false);    // guarded by mu
  uint64_t oldest_open = 0;                     // first block not finished; guarded by mu
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(7 + t);
      std::string got;
      for (;;) {
        uint64_t b;
        {
          std::unique_lock<std::mutex> l(mu);
          b = next++;
          if (b >= blocks) return;
          cv.wait(l, [&] { return oldest_open + kThreads > b; });
        }
        // The pause reorders requests; the spread bound above keeps that
        // disorder within the trail whatever the scheduler does.
        std::this_thread::sleep_for(std::chrono::microseconds(rng() % 3000));
        got.clear();
        auto n = (*r)->ReadWith(b * kReq, kReq, [&](std::span<const iovec> iov) {
          for (const iovec& v : iov) got.append(static_cast<const char*>(v.iov_base), v.iov_len);
          return Status();
        });
        if (!n.ok() || *n != kReq || got.compare(0, kReq, want_, b * kReq, kReq) != 0) ++bad;
        {
          std::lock_guard<std::mutex> l(mu);
          finished[b] = true;
          while (oldest_open < blocks && finished[oldest_open]) ++oldest_open;
        }
        cv.notify_all();
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0u) << "reads failed or returned other bytes than the library's";
  const uint64_t chunks = node_.gen->layout->ChunkSequenceLength(*node_.file);
  EXPECT_EQ(stats.chunks_loaded.load(), chunks) << "late requests of the stream reloaded chunks";
}

// The same on state.safetensors, whose chunks have many sizes (buffers sized
// to them, swapped through the pool as the window moves), with a pool of two
// chunks shared by two readers of it: buffers of the wrong size are given
// back and others taken while other threads pin, wait for and evict chunks.
TEST_F(ChunkReaderTest, ConcurrentReadersOfSafetensorsWithATightPoolFinishWithTheLibrarysBytes) {
  auto s = CreateStore(root_ + "/mix");  // 2 MiB chunks
  ASSERT_NE(s, nullptr);
  std::vector<TensorDef> defs;
  for (int i = 0; i < 4; ++i) {
    defs.push_back({fmt::format("l{}.bias", i), 1000 + 300 * static_cast<uint64_t>(i), {}});  // a few KiB
    defs.push_back({fmt::format("l{}.weight", i), (1ull << 20) + 12345 * static_cast<uint64_t>(i), {}});  // 2-3 chunks
  }
  CreateTensors(s.get(), defs);
  WriteStep(s.get(), 1);
  auto n = tree_->Resolve("/mix/latest/state.safetensors");
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  std::string want(n->file->size_bytes, '\0');
  ASSERT_TRUE(n->gen->layout->Read(*n->file, 0, want.data(), want.size()).ok());
  ChunkBufferPool pool(2 * (2ull << 20));
  ReadStats stats;
  auto r1 = ChunkReader::Open(n->gen, n->file, Reading(4), &pool, &stats);
  auto r2 = ChunkReader::Open(n->gen, n->file, Reading(4), &pool, &stats);
  ASSERT_TRUE(r1.ok() && r2.ok());
  uint64_t bad2 = 0;
  std::thread other([&] { bad2 = ConcurrentReads(r2->get(), want, 8ull << 20, 150); });
  EXPECT_EQ(ConcurrentReads(r1->get(), want, 8ull << 20, 150), 0u);
  other.join();
  EXPECT_EQ(bad2, 0u);
  // Each reader may exceed the pool's budget by one chunk buffer (to make progress).
  EXPECT_LE(pool.allocated_bytes(), 4 * (2ull << 20));
  EXPECT_GT(stats.chunks_loaded.load(), 0u);
}

// A read across a chunk boundary whose next chunk is already verified is
// handed out from both chunk buffers (two iovecs, no copy) with the library's
// bytes; the reader's count of copied requests stays 0.
TEST_F(ChunkReaderTest, ReadAcrossALoadedBoundaryIsTwoIovecsWithoutACopy) {
  ChunkBufferPool pool(1ull << 30);
  ReadStats stats;
  auto r = ChunkReader::Open(node_.gen, node_.file, Reading(4), &pool, &stats);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const uint64_t chunk = 2ull << 20;
  std::string got;
  auto collect = [&](std::span<const iovec> iov) {
    for (const iovec& v : iov) got.append(static_cast<const char*>(v.iov_base), v.iov_len);
    return Status();
  };
  // Chunk 1 loaded and verified first (this read waits for it) ...
  ASSERT_TRUE((*r)->ReadWith(chunk + 4096, 4096, collect).ok());
  ASSERT_EQ(got, want_.substr(chunk + 4096, 4096));
  // ... then 1 MiB from 512 KiB before its start: chunk 0 is loaded for it,
  // chunk 1 is still there.
  got.clear();
  size_t iovecs = 0;
  const uint64_t off = chunk - (512 << 10), len = 1 << 20;
  auto n = (*r)->ReadWith(off, len, [&](std::span<const iovec> iov) {
    iovecs = iov.size();
    return collect(iov);
  });
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  EXPECT_EQ(*n, len);
  EXPECT_EQ(got, want_.substr(off, len));
  EXPECT_EQ(iovecs, 2u);
  EXPECT_EQ(stats.bounced.load(), 0u);
  EXPECT_EQ(stats.requests.load(), 2u);
  EXPECT_EQ(stats.bytes.load(), 4096u + len);
}

// The same race made certain with sync points: reader A asks for chunk 10
// (nobody has loaded it) while the I/O thread is held before it looks for
// work; once A waits, reader B reads chunk 0 (loaded), which moves the window
// back to 0; then the I/O thread goes on. A must still get chunk 10 (it once
// waited forever: the I/O thread saw only the window at 0, all loaded).
TEST_F(ChunkReaderTest, ChunkAReaderWaitsForIsLoadedWhereverTheWindowMoved) {
  if (!SyncPoint::CompiledIn()) GTEST_SKIP() << "built without OPTSTATE_TEST_HOOKS";
  const uint64_t cs = 2ull << 20;
  std::mutex mu;
  std::condition_variable cv;
  bool io_held = false, a_waits = false, release = false, a_done = false;
  ChunkBufferPool pool(1ull << 30);
  auto r = ChunkReader::Open(node_.gen, node_.file, Reading(1), &pool);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  std::string got(4096, '\0');
  auto n = (*r)->Read(0, got.size(), got.data());  // chunk 0 loaded
  ASSERT_TRUE(n.ok()) << n.status().ToString();

  SyncPoint* sp = SyncPoint::Get();
  // Declared after the reader: releases the I/O thread and clears the points
  // before the reader is destroyed, however the test ends.
  struct Guard {
    std::function<void()> f;
    ~Guard() { f(); }
  } guard{[&] {
    {
      std::lock_guard<std::mutex> l(mu);
      release = true;
    }
    cv.notify_all();
    sp->Reset();
  }};
  sp->SetCallBack("chunk_reader.io_loop.before_work", [&](void*) {
    std::unique_lock<std::mutex> l(mu);
    io_held = true;
    cv.notify_all();
    cv.wait(l, [&] { return release; });
  });
  sp->SetCallBack("chunk_reader.pin.wait", [&](void* seq) {
    if (*static_cast<uint64_t*>(seq) != 10) return;
    std::lock_guard<std::mutex> l(mu);
    a_waits = true;
    cv.notify_all();
  });
  sp->EnableProcessing();

  std::string a_got(4096, '\0');
  Result<uint64_t> a_n = 0;
  std::thread a([&] {
    a_n = (*r)->Read(10 * cs + 123, a_got.size(), a_got.data());
    std::lock_guard<std::mutex> l(mu);
    a_done = true;
    cv.notify_all();
  });
  {
    // A waits for chunk 10 and the I/O thread has not looked for work since.
    std::unique_lock<std::mutex> l(mu);
    ASSERT_TRUE(cv.wait_for(l, kHangLimit, [&] { return io_held && a_waits; }))
        << "the I/O thread or reader A never reached its sync point";
  }
  n = (*r)->Read(100, got.size(), got.data());  // B: chunk 0, loaded
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  EXPECT_EQ(got.compare(0, got.size(), want_, 100, got.size()), 0);
  {
    std::unique_lock<std::mutex> l(mu);
    release = true;
    cv.notify_all();
    if (!cv.wait_for(l, kHangLimit, [&] { return a_done; })) {
      std::fprintf(stderr, "FAILED: reader A still waits for chunk 10 %lld s after the window moved to 0\n",
                   static_cast<long long>(kHangLimit.count() / 1000));
      std::fflush(stderr);
      std::_Exit(1);  // A cannot be joined
    }
  }
  a.join();
  ASSERT_TRUE(a_n.ok()) << a_n.status().ToString();
  EXPECT_EQ(*a_n, a_got.size());
  EXPECT_EQ(a_got.compare(0, a_got.size(), want_, 10 * cs + 123, a_got.size()), 0);
}

// A range lent to a consume that waits (a CachePusher's store waiting in the
// kernel for a READ) holds no pin: with a pool of one chunk buffer, reads of
// other chunks go on meanwhile (the lent chunk's slot gets a new buffer, past
// the budget), and the lent buffer keeps its bytes until the consume returns
// and then goes back to the pool.
TEST_F(ChunkReaderTest, ALentChunkKeepsItsBytesWhileOtherChunksLoadInATightPool) {
  const uint64_t cs = 2ull << 20;
  ChunkBufferPool pool(cs);
  ReadStats stats;
  auto r = ChunkReader::Open(node_.gen, node_.file, Reading(1), &pool, &stats);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  std::mutex mu;
  std::condition_variable cv;
  bool in_consume = false, release = false;
  std::string lent_got;
  Result<uint64_t> lent_n = 0;
  std::thread lender([&] {
    lent_n = (*r)->ReadWith(100, 4096, [&](std::span<const iovec> iov) {
      std::unique_lock<std::mutex> l(mu);
      in_consume = true;
      cv.notify_all();
      cv.wait(l, [&] { return release; });
      for (const iovec& v : iov) lent_got.append(static_cast<const char*>(v.iov_base), v.iov_len);
      return Status();
    }, /*count=*/true, /*lend=*/true);
  });
  {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return in_consume; });
  }
  // Chunks 2..9 while chunk 0 is lent; a reader left waiting fails the test
  // through the watchdog instead of hanging CI.
  std::mutex done_mu;
  std::condition_variable done_cv;
  bool reads_done = false;  // guarded by done_mu
  std::thread watchdog([&] {
    std::unique_lock<std::mutex> l(done_mu);
    if (!done_cv.wait_for(l, kHangLimit, [&] { return reads_done; })) {
      std::fprintf(stderr, "FAILED: reads of other chunks wait while chunk 0 is lent\n");
      std::fflush(stderr);
      std::_Exit(1);
    }
  });
  std::string got(4096, '\0');
  for (uint64_t c = 2; c < 10; ++c) {
    auto n = (*r)->Read(c * cs + 7, got.size(), got.data());
    ASSERT_TRUE(n.ok()) << n.status().ToString();
    EXPECT_EQ(got.compare(0, got.size(), want_, c * cs + 7, got.size()), 0) << "chunk " << c;
  }
  {
    std::lock_guard<std::mutex> l(done_mu);
    reads_done = true;
  }
  done_cv.notify_all();
  watchdog.join();
  {
    std::lock_guard<std::mutex> l(mu);
    release = true;
    cv.notify_all();
  }
  lender.join();
  ASSERT_TRUE(lent_n.ok()) << lent_n.status().ToString();
  EXPECT_EQ(*lent_n, 4096u);
  EXPECT_TRUE(lent_got == want_.substr(100, 4096)) << "the lent buffer was reused while lent";
  // At most one buffer past the budget while lent; none lost after.
  EXPECT_LE(pool.allocated_bytes(), 2 * cs);
  auto n = (*r)->Read(5, got.size(), got.data());
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  EXPECT_EQ(got.compare(0, got.size(), want_, 5, got.size()), 0);
  r->reset();
  EXPECT_LE(pool.allocated_bytes(), 2 * cs);
}

// The Prefetcher: once files are opened in tree order (the order cp -r, tar
// and rsync read a generation in), the next ones are opened and start loading
// before their reader comes; a reader taken from it gets the library's bytes;
// only those files are parked, only for the same Generation, an unused one is
// closed after kIdle, and opens out of order load nothing extra.
TEST_F(ChunkReaderTest, PrefetcherOpensTheNextFilesInTreeOrder) {
  auto s = CreateStore(root_ + "/p");
  ASSERT_NE(s, nullptr);
  CreateTensors(s.get(), {{"t0", 1000, {}}, {"t1", 700000, {}}, {"t2", 3, {}}, {"t3", 5000, {}}});
  WriteStep(s.get(), 1);
  auto n = tree_->Resolve("/p/latest/tensors/t0/main");
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  const std::shared_ptr<const Generation> gen = n->gen;
  // Tree order: depth first, siblings by name, but state.safetensors after
  // tensors/ (independent of IndexTree: the paths, sorted, with that one moved
  // to the end).
  std::vector<std::string> want_order;
  for (const vfs::CheckpointFile& f : gen->layout->files()) want_order.push_back(f.path);
  std::sort(want_order.begin(), want_order.end());  // no name here sorts between a dir and its files
  std::erase(want_order, std::string("state.safetensors"));
  want_order.push_back("state.safetensors");
  std::vector<std::string> order;
  for (const vfs::CheckpointFile* f : gen->files_in_tree_order) order.push_back(f->path);
  ASSERT_EQ(order, want_order);
  const auto& files = gen->files_in_tree_order;
  const size_t first = std::find(order.begin(), order.end(), "tensors/t0/exp_avg") - order.begin();
  ASSERT_LT(first + 4, files.size());

  ReadStats stats;
  ChunkBufferPool pool(1ull << 30);
  MountOptions o = Reading(8);
  o.prefetch_files = 2;
  // Every round the prefetcher runs (the position it opened files after), and
  // how often its thread found no round to run.
  std::mutex mu;
  std::condition_variable cv;
  std::vector<uint32_t> rounds;  // guarded by mu
  uint64_t idle = 0;             // guarded by mu
  SyncPoint* sp = SyncPoint::Get();
  sp->SetCallBack("prefetcher.round_done", [&](void* after) {
    std::lock_guard<std::mutex> l(mu);
    rounds.push_back(*static_cast<uint32_t*>(after));
    cv.notify_all();
  });
  sp->SetCallBack("prefetcher.idle", [&](void*) {
    std::lock_guard<std::mutex> l(mu);
    ++idle;
    cv.notify_all();
  });
  sp->EnableProcessing();
  struct ResetSyncPoints {
    ~ResetSyncPoints() { SyncPoint::Get()->Reset(); }
  } reset_sync_points;
  Prefetcher pf(o, &pool, &stats);
  // Out of order (one file, then a jump back): nothing is opened ahead. Once
  // the prefetcher's thread has looked for a round after both opens (it
  // passes "prefetcher.idle" under the lock Opened takes, so a pass counted
  // after Opened returned saw what Opened decided), no round has run.
  pf.Opened(gen, files[first + 4], false);
  pf.Opened(gen, files[first], false);
  {
    std::unique_lock<std::mutex> l(mu);
    const uint64_t idle_before = idle;
    ASSERT_TRUE(cv.wait_for(l, kHangLimit, [&] { return idle > idle_before; })) << "the prefetcher's thread hangs";
    EXPECT_TRUE(rounds.empty()) << "an open out of tree order started a round after position " << rounds[0];
  }
  EXPECT_EQ(pf.parked(), 0u);
  EXPECT_EQ(stats.chunks_loaded.load(), 0u);
  // In tree order (first, then the file after it): the two after that.
  pf.Opened(gen, files[first + 1], false);
  {
    std::unique_lock<std::mutex> l(mu);
    ASSERT_TRUE(cv.wait_for(l, kHangLimit, [&] { return !rounds.empty(); })) << "the prefetcher's round never ended";
    EXPECT_EQ(rounds, std::vector<uint32_t>{static_cast<uint32_t>(first + 1)});
  }
  // Each parked reader loads its first chunks on its own thread.
  EXPECT_TRUE(WaitFor([&] { return stats.chunks_loaded.load() >= 2; }));
  ASSERT_EQ(pf.parked(), 2u);
  // Loaded before any reader asked: only the Prefetcher's readers exist.
  EXPECT_GE(stats.chunks_loaded.load(), 2u);
  EXPECT_EQ(stats.requests.load(), 0u);
  EXPECT_EQ(pf.Take(gen.get(), files[first + 1]), nullptr);  // the opened one: not parked
  EXPECT_EQ(pf.Take(gen.get(), files[first + 4]), nullptr);  // beyond prefetch_files
  // Another Generation object of the same store (a snapshot) does not match.
  ASSERT_TRUE(s->CreateSnapshot("snap").ok());
  auto other = tree_->Resolve("/p/snapshots/snap/" + order[first + 2]);
  ASSERT_TRUE(other.ok()) << other.status().ToString();
  EXPECT_EQ(pf.Take(other->gen.get(), other->file), nullptr);

  const vfs::CheckpointFile* next = files[first + 2];
  std::unique_ptr<ChunkReader> r = pf.Take(gen.get(), next);
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(&r->file(), next);
  EXPECT_EQ(pf.parked(), 1u);
  EXPECT_EQ(stats.prefetched.load(), 1u);
  std::string want(next->size_bytes, '\0'), got(want.size(), '\0');
  ASSERT_TRUE(gen->layout->Read(*next, 0, want.data(), want.size()).ok());
  auto got_n = r->Read(0, got.size(), got.data());
  ASSERT_TRUE(got_n.ok()) << got_n.status().ToString();
  EXPECT_EQ(*got_n, want.size());
  EXPECT_EQ(got, want);

  // The one left is closed once it has been parked for kIdle.
  EXPECT_TRUE(WaitFor([&] { return pf.parked() == 0; })) << pf.parked() << " readers still parked";
}

// Readers of a small field take buffers of its size, not a chunk's: a burst
// of opens (each loading its first chunk at once) of a trainer's snapshot,
// mostly norms and biases of a few KiB, used to take a whole chunk each, past
// the pool's budget (`must`), 3 GiB for 400 open files on the dev VM.
TEST_F(ChunkReaderTest, ReadersOfSmallFieldsTakeSmallBuffers) {
  auto s = CreateStore(root_ + "/n");
  ASSERT_NE(s, nullptr);
  CreateTensors(s.get(), {{"norm", 1000, {}}});  // 4000 bytes a field
  WriteStep(s.get(), 1);
  auto n = tree_->Resolve("/n/latest/tensors/norm/exp_avg");
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  std::string want(n->file->size_bytes, '\0');
  ASSERT_TRUE(n->gen->layout->Read(*n->file, 0, want.data(), want.size()).ok());
  ReadStats stats;
  const uint64_t chunk = n->gen->view->identity().chunk_size_bytes;
  ChunkBufferPool pool(chunk);  // room for one chunk
  std::vector<std::unique_ptr<ChunkReader>> readers;
  for (int i = 0; i < 64; ++i) {
    auto r = ChunkReader::Open(n->gen, n->file, Reading(8), &pool, &stats);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    readers.push_back(std::move(r).value());
  }
  WaitFor([&] { return stats.chunks_loaded.load() >= 64; });
  EXPECT_EQ(stats.chunks_loaded.load(), 64u);
  EXPECT_LE(pool.allocated_bytes(), 64u * 4096) << "64 readers of a 4000-byte field";
  for (auto& r : readers) {
    std::string got(want.size(), '\0');
    auto k = r->Read(0, got.size(), got.data());
    ASSERT_TRUE(k.ok()) << k.status().ToString();
    EXPECT_EQ(*k, want.size());
    EXPECT_EQ(got, want);
  }
}

// state.safetensors puts runs of one-chunk fields of a few KiB (norms,
// biases) between fields of whole chunks. A reader that counted its
// read-ahead in chunks had only those few KiB ahead inside such a run, so the
// next big field was loaded only once the reader asked for it (waits in every
// `cp` of a trainer's snapshot); counted in bytes, the window reaches across
// the run into the next big field, and a sequential read still loads every
// chunk once and holds no more than (readahead + 1) chunk buffers.
TEST_F(ChunkReaderTest, SafetensorsReadAheadReachesAcrossRunsOfSmallFields) {
  auto s = CreateStore(root_ + "/st");  // 2 MiB chunks
  ASSERT_NE(s, nullptr);
  std::vector<TensorDef> defs = {{"a_big", 2ull << 20, {}}};  // 8 MiB a field: 4 chunks
  for (int i = 0; i < 8; ++i) defs.push_back({fmt::format("b_norm{}", i), 1000, {}});  // 4000 bytes a field
  defs.push_back({"c_big", 2ull << 20, {}});
  CreateTensors(s.get(), defs);
  WriteStep(s.get(), 1);
  auto n = tree_->Resolve("/st/latest/state.safetensors");
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  const CheckpointLayout& layout = *n->gen->layout;
  const uint64_t seqs = layout.ChunkSequenceLength(*n->file);
  ASSERT_EQ(seqs, 3u * (4 + 8 + 4));
  std::string want(n->file->size_bytes, '\0');
  ASSERT_TRUE(layout.Read(*n->file, 0, want.data(), want.size()).ok());
  // The first chunk of c_big and the last of a_big in the sequence.
  const std::vector<TensorInfo>& tensors = n->gen->view->tensors();  // sorted by name
  ASSERT_EQ(tensors.front().name, "a_big");
  ASSERT_EQ(tensors.back().name, "c_big");
  uint64_t c_first = seqs, a_last = 0;
  for (uint64_t i = 0; i < seqs; ++i) {
    const ChunkRef r = layout.ChunkAt(*n->file, i);
    if (r.tensor_id == tensors.front().id) a_last = i;
    if (r.tensor_id == tensors.back().id && c_first == seqs) c_first = i;
  }
  ASSERT_EQ(c_first, a_last + 1 + 3 * 8) << "the norms lie between the big fields";

  ReadStats stats;
  ChunkBufferPool pool(1ull << 30);
  constexpr uint32_t kReadahead = 8;  // 16 MiB of 2 MiB chunks
  auto r = ChunkReader::Open(n->gen, n->file, Reading(kReadahead), &pool, &stats);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  std::string got(want.size(), '\0');
  constexpr uint64_t kReq = 1ull << 20;
  uint64_t off = 0;
  auto read_to = [&](uint64_t end) {
    for (; off < end; off += kReq) {
      auto k = (*r)->Read(off, kReq, got.data() + off);
      ASSERT_TRUE(k.ok()) << k.status().ToString();
      ASSERT_EQ(*k, std::min(kReq, want.size() - off));
    }
  };
  // Read up to a_big's last chunk (it lies in the last request before the norms).
  uint64_t at_last = 0;
  for (const CheckpointSegment& seg : layout.MapRange(*n->file, 0, want.size())) {
    if (seg.memory == nullptr && seg.chunk_seq == a_last) at_last = seg.dst_offset;
  }
  read_to(at_last / kReq * kReq + kReq);
  // The window (16 MiB after a_big's last chunk) covers the 24 norm fields and
  // then at least four of c_big's chunks; a window of 8 chunks ends inside the norms.
  const uint64_t reach = c_first + 4;
  WaitFor([&] { return stats.chunks_loaded.load() >= reach; });
  EXPECT_GE(stats.chunks_loaded.load(), reach) << "read-ahead stopped inside the run of small fields";
  // Buffers: at most readahead + 1 of a chunk, and the norms' 4 KiB ones.
  const uint64_t bound = (kReadahead + 1) * (2ull << 20) + 3 * 8 * 4096;
  EXPECT_LE(pool.allocated_bytes(), bound);
  read_to(want.size());
  EXPECT_TRUE(got == want) << "bytes differ from the library's";
  EXPECT_EQ(stats.chunks_loaded.load(), seqs) << "a sequential read loaded some chunk twice";
  EXPECT_LE(pool.allocated_bytes(), bound);
}

// A path inside a snapshot the tree holds resolves without a catch-up while
// the last one is at most snapshot_recheck_ms old (a snapshot is immutable
// while it exists; a catch-up every 20 ms under the store's lock was most of
// what stat and open cost in a `cp -r`); once that has passed, a released
// snapshot's paths are gone. Both trees catch up on every other lookup
// (catchup_interval_ms 0); one never rechecks within the test, the other
// rechecks at every lookup, so neither outcome depends on elapsed time.
TEST_F(ChunkReaderTest, HeldSnapshotPathsSkipTheCatchUpUntilTheRecheck) {
  auto s = CreateStore(root_ + "/r");
  ASSERT_NE(s, nullptr);
  CreateTensors(s.get(), {{"t", 1000, {}}});
  WriteStep(s.get(), 1);
  ASSERT_TRUE(s->CreateSnapshot("a").ok());
  MountOptions o = tree_->options();
  o.catchup_interval_ms = 0;
  o.snapshot_recheck_ms = 3600 * 1000;
  StoreTree held(o);
  o.snapshot_recheck_ms = 0;
  StoreTree tree(o);
  auto first = held.Resolve("/r/snapshots/a/tensors/t/main");
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  auto first_rechecked = tree.Resolve("/r/snapshots/a/tensors/t/main");
  ASSERT_TRUE(first_rechecked.ok()) << first_rechecked.status().ToString();
  ASSERT_TRUE(s->ReleaseSnapshot("a").ok());
  auto again = held.Resolve("/r/snapshots/a/tensors/t/main");
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->gen.get(), first->gen.get()) << "the held generation, without a catch-up";
  auto gone = tree.Resolve("/r/snapshots/a/tensors/t/main");
  EXPECT_TRUE(gone.status().IsNotFound()) << (gone.ok() ? "still resolves after the recheck" : gone.status().ToString());
  auto listing = tree.Resolve("/r/snapshots");
  ASSERT_TRUE(listing.ok()) << listing.status().ToString();
  auto names = tree.List(*listing);
  ASSERT_TRUE(names.ok()) << names.status().ToString();
  EXPECT_TRUE(names->empty()) << (*names)[0];
}

// The Prefetcher stops at prefetch_bytes as well as at prefetch_files: runs
// of tiny files count their bytes, a file of several chunks counts the two it
// loads, and the file that crosses the bound is the last one opened.
TEST_F(ChunkReaderTest, PrefetcherStopsAtItsByteBound) {
  if (!SyncPoint::CompiledIn()) GTEST_SKIP() << "built without OPTSTATE_TEST_HOOKS";
  auto s = CreateStore(root_ + "/pb");
  ASSERT_NE(s, nullptr);
  CreateTensors(s.get(), {{"t0", 1000, {}}, {"t1", 2000000, {}}, {"t2", 3, {}}, {"t3", 5000, {}}});
  WriteStep(s.get(), 1);
  auto n = tree_->Resolve("/pb/latest/tensors/t0/main");
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  const std::shared_ptr<const Generation> gen = n->gen;
  const auto& files = gen->files_in_tree_order;
  size_t first = 0;
  while (first < files.size() && files[first]->path != "tensors/t0/exp_avg") ++first;
  ASSERT_LT(first + 6, files.size());
  ASSERT_EQ(files[first + 2]->path, "tensors/t0/main");
  ASSERT_EQ(files[first + 3]->path, "tensors/t1/exp_avg");  // 8 MB: 4 chunks of 2 MiB
  const uint64_t chunk = gen->view->identity().chunk_size_bytes;
  ASSERT_GT(files[first + 3]->size_bytes, 2 * chunk);
  struct Case {
    uint64_t bytes;
    size_t parked;
  };
  // t0/main (4000 B) alone reaches 4000; with t1/exp_avg (2 chunks counted) 4000 + 2 chunks.
  for (const Case& c : {Case{1, 1}, Case{4000, 1}, Case{4001, 2}, Case{4000 + 2 * chunk, 2},
                        Case{4001 + 2 * chunk, 3}}) {
    ReadStats stats;
    ChunkBufferPool pool(1ull << 30);
    MountOptions o = Reading(8);
    o.prefetch_files = 16;
    o.prefetch_bytes = c.bytes;
    // The second open starts the one round (the first has no previous open
    // to follow); once it is done, no more files come.
    std::mutex mu;
    std::condition_variable cv;
    bool round_done = false;
    SyncPoint* sp = SyncPoint::Get();
    sp->SetCallBack("prefetcher.round_done", [&](void* after) {
      if (*static_cast<uint32_t*>(after) != first + 1) return;
      std::lock_guard<std::mutex> l(mu);
      round_done = true;
      cv.notify_all();
    });
    sp->EnableProcessing();
    Prefetcher pf(o, &pool, &stats);
    pf.Opened(gen, files[first], false);
    pf.Opened(gen, files[first + 1], false);
    {
      std::unique_lock<std::mutex> l(mu);
      const bool done = cv.wait_for(l, kHangLimit, [&] { return round_done; });
      l.unlock();
      sp->Reset();
      ASSERT_TRUE(done) << "the prefetcher's round never ended";
    }
    EXPECT_EQ(pf.parked(), c.parked) << "prefetch_bytes " << c.bytes;
    // Exactly the files right after the opened one.
    for (size_t k = 0; k < c.parked; ++k) {
      EXPECT_NE(pf.Take(gen.get(), files[first + 2 + k]), nullptr) << c.bytes << ": " << files[first + 2 + k]->path;
    }
  }
}

// The pusher stores a sequential reader's file into the page cache from the
// end of its first READ (at offset 0) to EOF: contiguous, page-aligned
// ranges, each one notification (the kernel marks a page up to date only when
// one notification fills it whole), with the library's bytes. state.safetensors
// of odd-sized fields puts most chunk boundaries inside a page; a pusher that
// stored each chunk's piece by itself left those pages half-filled. Chunks
// load once each; the pusher's reads are not counted as the kernel's.
TEST_F(ChunkReaderTest, PusherStoresPageAlignedRangesWithTheLibrarysBytes) {
  auto s = CreateStore(root_ + "/push");  // 2 MiB chunks
  ASSERT_NE(s, nullptr);
  std::vector<TensorDef> defs;
  for (int i = 0; i < 3; ++i) {
    defs.push_back({fmt::format("l{}.bias", i), 1000 + 300 * static_cast<uint64_t>(i), {}});
    defs.push_back({fmt::format("l{}.weight", i), (1ull << 20) + 12345 * static_cast<uint64_t>(i), {}});
  }
  CreateTensors(s.get(), defs);
  WriteStep(s.get(), 1);
  auto n = tree_->Resolve("/push/latest/state.safetensors");
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  const uint64_t size = n->file->size_bytes;
  std::string want(size, '\0');
  ASSERT_TRUE(n->gen->layout->Read(*n->file, 0, want.data(), want.size()).ok());
  const uint64_t seqs = n->gen->layout->ChunkSequenceLength(*n->file);

  ChunkBufferPool pool(1ull << 30);
  ReadStats stats;
  auto r = ChunkReader::Open(n->gen, n->file, Reading(4), &pool, &stats);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  std::shared_ptr<ChunkReader> reader(std::move(r).value());
  struct Stored {
    uint64_t offset;
    std::string bytes;
  };
  std::mutex mu;
  std::vector<Stored> stored;
  CachePusher pusher(reader, [&](uint64_t offset, std::span<const iovec> iov) {
    Stored st{offset, {}};
    for (const iovec& v : iov) st.bytes.append(static_cast<const char*>(v.iov_base), v.iov_len);
    std::lock_guard<std::mutex> l(mu);
    stored.push_back(std::move(st));
    return 0;
  }, &stats);
  constexpr uint64_t kFirstRead = 128 << 10;  // the kernel's first READ, served by the reader
  std::string first;
  ASSERT_TRUE(reader->ReadWith(0, kFirstRead, [&](std::span<const iovec> iov) {
    for (const iovec& v : iov) first.append(static_cast<const char*>(v.iov_base), v.iov_len);
    return Status();
  }).ok());
  pusher.OnRead(0, kFirstRead);
  pusher.Join();

  ASSERT_FALSE(stored.empty());
  uint64_t at = kFirstRead;
  for (const Stored& st : stored) {
    EXPECT_EQ(st.offset, at) << "ranges are contiguous from the first READ's end";
    EXPECT_EQ(st.offset % CachePusher::kPageBytes, 0u) << st.offset;
    const uint64_t end = st.offset + st.bytes.size();
    EXPECT_TRUE(end % CachePusher::kPageBytes == 0 || end == size) << "a range ends inside page " << end / 4096;
    EXPECT_TRUE(st.bytes == want.substr(st.offset, st.bytes.size())) << "bytes at " << st.offset;
    at = end;
  }
  EXPECT_EQ(at, size) << "the push reaches EOF";
  EXPECT_EQ(pusher.pushed_bytes(), size - kFirstRead);
  EXPECT_EQ(stats.pushes.load(), 1u);
  EXPECT_EQ(stats.requests.load(), 1u) << "only the kernel's READ counts as a read";
  EXPECT_EQ(stats.chunks_loaded.load(), seqs) << "each chunk loaded once";
}

// A file whose first READ is not at offset 0 (a reader that seeks: a header
// parser, an mmap'd slice) is never pushed.
TEST_F(ChunkReaderTest, PusherLeavesAFileFirstReadElsewhereAlone) {
  ChunkBufferPool pool(1ull << 30);
  ReadStats stats;
  auto r = ChunkReader::Open(node_.gen, node_.file, Reading(4), &pool, &stats);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  std::atomic<uint64_t> calls{0};
  CachePusher pusher(std::shared_ptr<ChunkReader>(std::move(r).value()), [&](uint64_t, std::span<const iovec>) {
    ++calls;
    return 0;
  }, &stats);
  pusher.OnRead(4ull << 20, 128 << 10);
  pusher.OnRead(0, 128 << 10);  // later READs at 0 do not start it either
  pusher.Join();
  EXPECT_EQ(calls.load(), 0u);
  EXPECT_EQ(pusher.pushed_bytes(), 0u);
  EXPECT_EQ(stats.pushes.load(), 0u);
}

// A READ far from the push front (a seek: more than far_bytes ahead of it or
// behind it) ends the push: the pusher stores what it was storing and stops,
// instead of filling the page cache with the rest of a file the reader jumps
// around in. The store of the first range is held until the seek arrives.
TEST_F(ChunkReaderTest, PusherStopsAtAFarRead) {
  for (const bool ahead : {true, false}) {
    ChunkBufferPool pool(1ull << 30);
    ReadStats stats;
    auto r = ChunkReader::Open(node_.gen, node_.file, Reading(4), &pool, &stats);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    std::mutex mu;
    std::condition_variable cv;
    bool released = false;     // guarded by mu
    bool first_store = false;  // guarded by mu
    std::atomic<uint64_t> calls{0};
    constexpr uint64_t kFar = 4ull << 20;  // the file: 32 MiB in 2 MiB chunks
    CachePusher pusher(std::shared_ptr<ChunkReader>(std::move(r).value()), [&](uint64_t, std::span<const iovec>) {
      if (calls++ == 0) {
        std::unique_lock<std::mutex> l(mu);
        first_store = true;
        cv.notify_all();
        cv.wait(l, [&] { return released; });
      }
      return 0;
    }, &stats, kFar);
    pusher.OnRead(0, 128 << 10);
    {
      std::unique_lock<std::mutex> l(mu);
      cv.wait(l, [&] { return first_store; });
    }
    // The push front is in the first chunk now.
    if (ahead) {
      pusher.OnRead(20ull << 20, 128 << 10);
    } else {
      pusher.OnRead(128 << 10, 4096);  // near: the push goes on
      pusher.OnRead(0, 4096);          // near too (behind by less than kFar)
    }
    {
      std::lock_guard<std::mutex> l(mu);
      released = true;
    }
    cv.notify_all();
    pusher.Join();
    const uint64_t size = node_.file->size_bytes;
    if (ahead) {
      EXPECT_LE(pusher.pushed_bytes(), 2ull << 20) << "pushed on past a seek";
    } else {
      EXPECT_EQ(pusher.pushed_bytes(), size - (128 << 10)) << "stopped at a near READ";
    }
  }
}

}  // namespace
}  // namespace optstate::mount
