#include "common/logging.h"

#include <cstdio>
#include <mutex>

namespace tfmpi {

namespace {
int g_rank = -1;
std::mutex g_mu;

void Emit(const char* level, const std::string& msg) {
  std::lock_guard<std::mutex> lock(g_mu);
  std::fprintf(stderr, "[tf_mpi rank %d] %s: %s\n", g_rank, level, msg.c_str());
  std::fflush(stderr);
}
}  // namespace

void SetLogRank(int rank) { g_rank = rank; }
void LogInfo(const std::string& msg) { Emit("INFO", msg); }
void LogWarning(const std::string& msg) { Emit("WARNING", msg); }
void LogError(const std::string& msg) { Emit("ERROR", msg); }

}  // namespace tfmpi
