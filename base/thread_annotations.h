// Clang's thread-safety annotations (-Wthread-safety): lock rules the
// compiler checks, as leveldb's port/thread_annotations.h. A member declared
// GUARDED_BY(mu_) may only be touched with mu_ held; a function declared
// REQUIRES(mu_) only called with it held. Under other compilers (gcc builds
// the product) they expand to nothing; a ctest runs clang++ -fsyntax-only
// -Wthread-safety over the annotated files (tests/base/CMakeLists.txt).
// The annotations need a capability type: base/mutex.h's Mutex (libstdc++'s
// std::mutex carries none).
#pragma once

#if defined(__clang__)
#define OPTSTATE_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define OPTSTATE_THREAD_ANNOTATION(x)
#endif

#define CAPABILITY(x) OPTSTATE_THREAD_ANNOTATION(capability(x))
#define SCOPED_CAPABILITY OPTSTATE_THREAD_ANNOTATION(scoped_lockable)
#define GUARDED_BY(x) OPTSTATE_THREAD_ANNOTATION(guarded_by(x))
#define PT_GUARDED_BY(x) OPTSTATE_THREAD_ANNOTATION(pt_guarded_by(x))
#define ACQUIRED_BEFORE(...) OPTSTATE_THREAD_ANNOTATION(acquired_before(__VA_ARGS__))
#define ACQUIRED_AFTER(...) OPTSTATE_THREAD_ANNOTATION(acquired_after(__VA_ARGS__))
#define REQUIRES(...) OPTSTATE_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define REQUIRES_SHARED(...) OPTSTATE_THREAD_ANNOTATION(requires_shared_capability(__VA_ARGS__))
#define ACQUIRE(...) OPTSTATE_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define ACQUIRE_SHARED(...) OPTSTATE_THREAD_ANNOTATION(acquire_shared_capability(__VA_ARGS__))
#define RELEASE(...) OPTSTATE_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define RELEASE_SHARED(...) OPTSTATE_THREAD_ANNOTATION(release_shared_capability(__VA_ARGS__))
#define TRY_ACQUIRE(...) OPTSTATE_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
#define EXCLUDES(...) OPTSTATE_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define ASSERT_CAPABILITY(x) OPTSTATE_THREAD_ANNOTATION(assert_capability(x))
#define RETURN_CAPABILITY(x) OPTSTATE_THREAD_ANNOTATION(lock_returned(x))
#define NO_THREAD_SAFETY_ANALYSIS OPTSTATE_THREAD_ANNOTATION(no_thread_safety_analysis)
