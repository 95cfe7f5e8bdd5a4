// Not built: base.thread_safety_plant runs clang's -Wthread-safety over this
// file and passes only when it reports the unguarded write below, so the
// check that guards the annotated product files is known to find one.
#include "base/mutex.h"
#include "base/thread_annotations.h"

namespace optstate {

class Counter {
 public:
  void Add() {
    MutexLock l(&mu_);
    ++count_;
  }
  void AddUnlocked() { ++count_; }  // the planted error

 private:
  Mutex mu_;
  int count_ GUARDED_BY(mu_) = 0;
};

}  // namespace optstate
