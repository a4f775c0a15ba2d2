#include "wait_policy.h"

#include <dlfcn.h>

namespace tfmpi {

namespace {
using SetYield = bool (*)(bool);  // returns the previous setting

SetYield Switch() {
  static const SetYield fn =
      reinterpret_cast<SetYield>(dlsym(RTLD_DEFAULT, "opal_progress_set_yield_when_idle"));
  return fn;
}
}  // namespace

bool YieldWhileWaiting::Supported() { return Switch() != nullptr; }

YieldWhileWaiting::YieldWhileWaiting(int64_t bytes, int64_t threshold) {
  if (threshold <= 0 || bytes < threshold || !Switch()) return;
  previous_ = Switch()(true);
  active_ = true;
}

YieldWhileWaiting::~YieldWhileWaiting() {
  if (active_) Switch()(previous_);
}

}  // namespace tfmpi
