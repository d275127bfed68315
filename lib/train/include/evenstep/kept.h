// A loop variable that survives a resume, declared where the loop declares
// it: one changed line each, also for a variable the loop declares inside
// its loop over epochs and resets there.
//
//   for (size_t epoch = es->first_epoch(); epoch != num_epochs; ++epoch) {
//     // was: float running_loss = 0.0; size_t num_correct = 0;
//     evenstep::KeptSum<float> running_loss(*es, "running_loss", 0.0);
//     evenstep::KeptSum<size_t> num_correct(*es, "num_correct", 0);
//     for (auto& batch : es->Batches(loader)) {
//       ...
//       running_loss += loss.item<float>() * batch.data.size(0);
//       num_correct += output.argmax(1).eq(batch.target).sum().item<int64_t>();
//       es->Backward(loss);
//     }
//     if (es->stopped()) break;
//     std::cout << running_loss / num_samples << " " << num_correct << "\n";
//   }
//
// Each declaration binds the name to the new variable, which starts at its
// initial value, except the first declaration in a resumed run: that one
// takes the value the checkpoint saved, so a run resumed inside an epoch
// goes on with that epoch's running sums and counters (a run resumed at an
// epoch's start finds the values of the new epoch's top, i.e. the initial
// ones). When the variable goes out of scope (the end of the epoch's body)
// the name is unbound: a checkpoint taken then (Finish after the loop)
// saves it as ended, and a resumed run starts it at its initial value.
//
// Kept<T> is saved as Session::Keep saves a variable (rank 0's value;
// every rank's should be the same); KeptSum<T> as Session::KeepSum: after
// every step it holds, on every rank, its value before the step plus what
// every rank added during the step (add before Backward). The first
// declaration of each name must come before the first step (later ones
// rebind it); a name is one kind and one type; two variables of one name
// may not live at once; a variable must not outlive its Session. Errors are
// returned by the next step, naming the variable.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include "evenstep/session.h"

namespace evenstep {

template <typename T>
class Kept {
  static_assert(std::is_arithmetic_v<T> || std::is_same_v<T, std::string>,
                "evenstep::Kept holds a number, a bool or a std::string (Session::Keep keeps "
                "vectors and tensors)");

 public:
  Kept(Session& session, std::string name, T initial = T())
      : Kept(session, std::move(name), std::move(initial), /*sum=*/false) {}
  ~Kept() { session_.UnbindKept(name_); }
  Kept(const Kept&) = delete;
  Kept& operator=(const Kept&) = delete;

  operator const T&() const { return value_; }
  const T& value() const { return value_; }
  Kept& operator=(const T& v) {
    value_ = v;
    return *this;
  }
  template <typename U>
  Kept& operator+=(const U& v) {
    value_ += v;
    return *this;
  }
  template <typename U>
  Kept& operator-=(const U& v) {
    value_ -= v;
    return *this;
  }
  template <typename U>
  Kept& operator*=(const U& v) {
    value_ *= v;
    return *this;
  }
  template <typename U>
  Kept& operator/=(const U& v) {
    value_ /= v;
    return *this;
  }
  Kept& operator++() {
    ++value_;
    return *this;
  }
  T operator++(int) { return value_++; }

 protected:
  Kept(Session& session, std::string name, T initial, bool sum)
      : session_(session), name_(std::move(name)), value_(std::move(initial)) {
    session_.BindKept(name_, &value_, sum);
  }

 private:
  Session& session_;
  const std::string name_;
  T value_;
};

template <typename T>
class KeptSum : public Kept<T> {
  static_assert(std::is_arithmetic_v<T> && !std::is_same_v<T, bool>,
                "evenstep::KeptSum holds a number");

 public:
  KeptSum(Session& session, std::string name, T initial = T())
      : Kept<T>(session, std::move(name), std::move(initial), /*sum=*/true) {}
  using Kept<T>::operator=;
};

// Stream mode (Session::Positions): a tensor with one row per stream (an
// LSTM's hidden state [layers, streams, hidden]), declared where the loop
// declares it, also at the top of each epoch:
//
//   evenstep::KeptRows h(*es, "h", torch::zeros({layers, rows, hidden}));  // was: auto h = ...
//   ... model->forward(data, std::make_tuple(h, c)) ...; h = state.detach();
//
// It holds this rank's rows (Session::OwnRows's) of `initial` (all the
// streams' rows), or, in a resumed run's first declaration, of what the
// checkpoint saved, so a run resumed inside an epoch goes on with every
// row's state. It is a tensor: use and assign it as the loop's own
// variable. Every checkpoint gathers all ranks' rows and saves the whole
// tensor ("stream/<name>"); when the variable leaves scope the name is
// unbound (ended: a checkpoint then has none, and a resumed run starts it at
// `initial`). `dim` is the streams' dimension (-1: the one dimension of
// the stream count's size). Copies (std::make_tuple's) share the binding;
// misuse is named by the next step.
class KeptRows : public at::Tensor {
 public:
  KeptRows(Session& session, std::string name, const at::Tensor& initial, int64_t dim = -1)
      : binding_(std::make_shared<Binding>(session, std::move(name))) {
    session.BindRows(binding_->name, this, initial, dim);
  }
  KeptRows(const KeptRows&) = default;
  // Assigns the value (this variable stays bound to its name).
  KeptRows& operator=(const KeptRows& other) {
    at::Tensor::operator=(static_cast<const at::Tensor&>(other));
    return *this;
  }
  using at::Tensor::operator=;

 private:
  struct Binding {
    Binding(Session& s, std::string n) : session(s), name(std::move(n)) {}
    ~Binding() { session.UnbindRows(name); }
    Session& session;
    const std::string name;
  };
  std::shared_ptr<Binding> binding_;
};

}  // namespace evenstep
