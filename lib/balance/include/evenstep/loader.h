// Loader<Data>: a load function that evenstep owns, made once before the
// training loop and handed to every Step:
//
//   auto batches = evenstep::Loader([data = my_data](const evenstep::MicroBatch& mb) {
//     return data.Batch(mb.samples);  // depends on the micro-batch only
//   });
//   for (...) (*es)->Step(batches, [&](const Batch& b) { return loss(b); });
//
// or, for a torch::data dataset, evenstep::LoaderOf(dataset) (torch_data.h).
//
// What owning it buys: BalancedStep runs a Loader on its data workers
// (--evenstep_data_workers, on by default for a Loader) and loads the next
// step's micro-batches while this step finishes (--evenstep_prefetch_next_step,
// on by default), which calls the function after Step has returned. A copy
// of a Loader shares the function; the last copy destroys it, so a load in
// flight never outlives what the function owns. Capture by value (or by
// shared_ptr) what it reads: references into the loop's scope are the one
// thing ownership cannot protect.
//
// Like torch::data's DataLoader, which gives each worker its own copy of the
// dataset, a Loader runs a copy of the function per concurrent call: copies
// are made from the function as first given (at most one per data worker)
// and reused, one thread at a time each. The function must therefore be
// copyable, and its result must depend only on the micro-batch (not on
// which copy loads it nor on the order of calls): then the step is the same
// for any number of workers.
//
// Thread-safety: operator() may be called from several threads at once.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#include "evenstep/sampler.h"  // MicroBatch

namespace evenstep {

template <typename Data>
class Loader {
 public:
  template <typename F, typename = std::enable_if_t<!std::is_same_v<std::decay_t<F>, Loader>>>
  explicit Loader(F&& fn)
      : copies_(std::make_shared<Copies<std::decay_t<F>>>(std::forward<F>(fn))) {}

  // Loads `mb` with a copy of the function that no other thread is using.
  Data operator()(const MicroBatch& mb) const { return copies_->Load(mb); }
  // Copies of one Loader share an identity (BalancedStep matches the
  // next step's loads, started early, to the Loader of the next Step).
  const void* id() const { return copies_.get(); }

 private:
  struct Source {
    virtual ~Source() = default;
    virtual Data Load(const MicroBatch& mb) = 0;
  };
  template <typename F>
  struct Copies final : Source {
    static_assert(std::is_copy_constructible_v<F>,
                  "evenstep::Loader copies its function for each data worker (as torch::data "
                  "copies a dataset per worker): capture by value what can be copied and by "
                  "shared_ptr what cannot");
    explicit Copies(F fn) : original(std::move(fn)) {}
    Data Load(const MicroBatch& mb) override {
      std::unique_ptr<F> copy;
      {
        std::lock_guard<std::mutex> lock(mu);
        if (idle.empty()) {
          copy = std::make_unique<F>(original);
        } else {
          copy = std::move(idle.back());
          idle.pop_back();
        }
      }
      // Back to the idle copies also when the function throws.
      struct GiveBack {
        Copies* self;
        std::unique_ptr<F>* copy;
        ~GiveBack() {
          std::lock_guard<std::mutex> lock(self->mu);
          self->idle.push_back(std::move(*copy));
        }
      } give_back{this, &copy};
      return (*copy)(mb);
    }
    const F original;  // never called: the template of every copy
    std::mutex mu;
    std::vector<std::unique_ptr<F>> idle;
  };
  std::shared_ptr<Source> copies_;
};

template <typename F>
Loader(F) -> Loader<std::decay_t<std::invoke_result_t<F&, const MicroBatch&>>>;

template <typename T>
struct IsLoader : std::false_type {};
template <typename Data>
struct IsLoader<Loader<Data>> : std::true_type {};

}  // namespace evenstep
