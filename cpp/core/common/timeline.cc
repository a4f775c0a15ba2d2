#include "common/timeline.h"

#include <filesystem>
#include <sstream>
#include <system_error>

namespace tfmpi {

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
      continue;
    }
    out += c;
  }
  return out + "\"";
}

bool Timeline::Start(const std::string& path) {
  Stop();
  std::lock_guard<std::mutex> lock(mu_);
  // TF_MPI_TIMELINE=runs/today/trace.json should not fail for want of a folder.
  const auto parent = std::filesystem::path(path).parent_path();
  std::error_code ignored;  // if it cannot be made, fopen below reports the failure
  if (!parent.empty()) std::filesystem::create_directories(parent, ignored);
  file_ = std::fopen(path.c_str(), "w");
  if (!file_) return false;
  std::fputs("{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n", file_);
  first_ = true;
  tracks_.clear();
  origin_ = Clock::now();
  active_ = true;
  return true;
}

void Timeline::Stop() {
  std::lock_guard<std::mutex> lock(mu_);
  active_ = false;
  if (!file_) return;
  std::fputs("\n]}\n", file_);
  std::fclose(file_);
  file_ = nullptr;
}

double Timeline::Micros(Clock::time_point t) const {
  return std::chrono::duration<double, std::micro>(t - origin_).count();
}

void Timeline::Write(const std::string& event) {
  if (!first_) std::fputs(",\n", file_);
  first_ = false;
  std::fputs(event.c_str(), file_);
}

int Timeline::TrackId(const std::string& track) {
  auto it = tracks_.find(track);
  if (it != tracks_.end()) return it->second;
  const int id = static_cast<int>(tracks_.size()) + 1;
  tracks_.emplace(track, id);
  Write("{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": 0, \"tid\": " + std::to_string(id) +
        ", \"args\": {\"name\": " + JsonString(track) + "}}");
  return id;
}

void Timeline::Emit(const std::string& track, const char* name, const char* phase_fields,
                    Clock::time_point at, double duration_us, const std::string& args_json) {
  if (!active()) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (!file_) return;
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(3);
  os << "{\"name\": \"" << name << "\", " << phase_fields << ", \"pid\": 0, \"tid\": " << TrackId(track)
     << ", \"ts\": " << Micros(at);
  if (duration_us >= 0) os << ", \"dur\": " << duration_us;
  if (!args_json.empty()) os << ", \"args\": " << args_json;
  os << "}";
  Write(os.str());
}

void Timeline::Span(const std::string& track, const char* name, Clock::time_point start, Clock::time_point end,
                    const std::string& args_json) {
  Emit(track, name, "\"ph\": \"X\"", start, std::max(0.0, Micros(end) - Micros(start)), args_json);
}

void Timeline::Instant(const std::string& track, const char* name, Clock::time_point at,
                       const std::string& args_json) {
  Emit(track, name, "\"ph\": \"i\", \"s\": \"t\"", at, -1.0, args_json);
}

}  // namespace tfmpi
