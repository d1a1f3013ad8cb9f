// Host memory reused by size within a training step or a prefill (switched on around it, off
// after it).
//
// A training step allocates and frees the same tensor sizes over and over: each layer's
// activations, the recomputed ones of gradient checkpointing, their gradients. glibc maps every
// block over its mmap threshold afresh (host_memory.py fixes that threshold, so that the process
// gives each step's peak back), and the kernel zero-fills each new page on first touch: on the
// embedded model a third of a step went to those page faults. While on, this allocator keeps each
// block freed, by its exact size, and hands it to the next request of that size. It keeps up to a
// total it is given, the oldest freed first out: that bounds what a step adds to its peak, and
// blocks of sizes that never come again (a grown KV cache's old layers) leave for ones that do.
// Switching it off frees them all, so between steps the process keeps nothing more than before;
// off, it allocates and frees as torch's own allocator does. Blocks it handed out that live on
// (the optimizer's state) are freed when they die.

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/library.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <iterator>
#include <list>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

class StepAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t bytes) override {
    void* data = take(bytes);
    if (data == nullptr) {
      data = c10::alloc_cpu(bytes);
      if (data == nullptr) return {nullptr, nullptr, &StepAllocator::release, c10::Device(c10::DeviceType::CPU)};
      std::lock_guard<std::mutex> lock(mutex_);
      sizes_[data] = bytes;
    }
    return {data, data, &StepAllocator::release, c10::Device(c10::DeviceType::CPU)};
  }

  // oneDNN takes its scratch memory through raw_allocate, which needs this.
  c10::DeleterFnPtr raw_deleter() const override { return &StepAllocator::release; }

  void copy_data(void* dest, const void* src, size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // Starts keeping freed blocks, up to `max_kept_bytes` (on), or stops and frees every kept block
  // once as many offs as ons have come (two engines in one process each switch it). The first on
  // installs this allocator as torch's CPU allocator for good: a block must go back to the
  // allocator that made it, and oneDNN frees its scratch memory through whichever one is current.
  // False where another allocator of higher priority stays.
  bool set(bool on, size_t max_kept_bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (on) {
      if (c10::GetCPUAllocator() != this) c10::SetCPUAllocator(this);
      if (c10::GetCPUAllocator() != this) return false;
      max_kept_bytes_ = max_kept_bytes;
      ++users_;
      return true;
    }
    if (users_ > 0 && --users_ > 0) return true;
    for (void* data : order_) {
      sizes_.erase(data);
      c10::free_cpu(data);
    }
    order_.clear();
    by_size_.clear();
    kept_bytes_ = 0;
    return true;
  }

  static StepAllocator& instance() {
    static auto* allocator = new StepAllocator();  // never destroyed: tensors may die after it
    return *allocator;
  }

 private:
  using Kept = std::list<void*>;  // oldest first

  void* take(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = by_size_.find(bytes);
    if (found == by_size_.end() || found->second.empty()) return nullptr;
    Kept::iterator newest = found->second.back();  // the most recently freed: likeliest still in cache
    found->second.pop_back();
    void* data = *newest;
    order_.erase(newest);
    kept_bytes_ -= bytes;
    return data;
  }

  // Keeps a block of ours, then frees the oldest kept blocks until the total is within bounds.
  // A block this allocator did not make (taken with raw_allocate before it was installed) is
  // freed as torch's own allocator frees it.
  static void release(void* data) {
    StepAllocator& self = instance();
    std::vector<void*> freed;
    {
      std::lock_guard<std::mutex> lock(self.mutex_);
      auto found = self.sizes_.find(data);
      size_t bytes = found == self.sizes_.end() ? 0 : found->second;
      if (self.users_ == 0 || found == self.sizes_.end() || bytes > self.max_kept_bytes_) {
        if (found != self.sizes_.end()) self.sizes_.erase(found);
        freed.push_back(data);
      } else {
        self.order_.push_back(data);
        self.by_size_[bytes].push_back(std::prev(self.order_.end()));
        self.kept_bytes_ += bytes;
        while (self.kept_bytes_ > self.max_kept_bytes_) {
          void* oldest = self.order_.front();
          size_t oldest_bytes = self.sizes_[oldest];
          self.by_size_[oldest_bytes].pop_front();  // the oldest of its size, too
          self.order_.pop_front();
          self.sizes_.erase(oldest);
          self.kept_bytes_ -= oldest_bytes;
          freed.push_back(oldest);
        }
      }
    }
    for (void* old : freed) c10::free_cpu(old);
  }

  std::mutex mutex_;
  int users_ = 0;  // ons not yet matched by an off
  size_t max_kept_bytes_ = 0;
  Kept order_;
  std::unordered_map<void*, size_t> sizes_;  // every block this allocator made that is not freed
  std::unordered_map<size_t, std::deque<Kept::iterator>> by_size_;
  size_t kept_bytes_ = 0;
};

bool reuse_step_memory(bool on, int64_t max_kept_bytes) {
  TORCH_CHECK(max_kept_bytes >= 0, "reuse_step_memory: max_kept_bytes must be >= 0, not ", max_kept_bytes);
  return StepAllocator::instance().set(on, static_cast<size_t>(max_kept_bytes));
}

// Whether this allocator is torch's CPU allocator now: once installed it stays for the process.
bool step_memory_installed() { return c10::GetCPUAllocator() == &StepAllocator::instance(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(art_cpu_kernels, m) {
  m.def("reuse_step_memory(bool on, int max_kept_bytes) -> bool", &reuse_step_memory);
  m.def("step_memory_installed() -> bool", &step_memory_installed);
}
