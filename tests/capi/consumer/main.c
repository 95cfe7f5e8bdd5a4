/* A C trainer's view of an installed optstate: find_package(optstate),
 * <optstate/c.h>, liboptstate.so. Exits 0 when the library answers with the
 * expected version and a NotFound error naming the missing store. */
#include <optstate/c.h>
#include <stdio.h>
#include <string.h>

int main(void) {
  char* err = NULL;
  optstate_store_t* store = NULL;
  int code = optstate_store_open("/nonexistent/optstate-store", NULL, &store, &err);
  printf("liboptstate %s (C ABI %d): %s: %s\n", optstate_version(), optstate_abi_version(),
         optstate_code_name(code), err ? err : "");
  int ok = optstate_abi_version() == OPTSTATE_C_ABI_VERSION && code == OPTSTATE_NOT_FOUND && store == NULL &&
           err != NULL && strstr(err, "/nonexistent/optstate-store") != NULL;
  optstate_free(err);
  return ok ? 0 : 1;
}
