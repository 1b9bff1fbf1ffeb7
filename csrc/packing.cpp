// Sequence packing and balancing for fastgrpo._C. Each function has a pure-Python twin in
// fastgrpo/packing.py that makes the same decisions in the same order, so both return identical
// results; the Python side validates input (lengths are non-negative integers, budget >= 1)
// before calling here, so these functions only re-check what would corrupt memory.
//
//  - pack_ffd: first-fit-decreasing bin packing (Johnson 1973). The first bin with room is found
//    in O(log n) with a max segment tree over remaining capacities whose unopened leaves hold the
//    full budget, so "first bin with room" and "open a new bin" are one query: O(n log n) total
//    instead of the textbook O(n * bins) scan (100 000 sequences into ~5 000 bins).
//  - balance_kk: Karmarkar-Karp largest differencing method generalised to k-way partitions
//    (Korf 2009 "multi-way number partitioning"; the equal-size variant follows verl's
//    seqlen_balancing). Subset member lists are merged small-into-large: O(n log n) copies.
//  - cu_seqlens / position_ids builders for the packed (varlen) attention layout.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <queue>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

using i64 = int64_t;
using LenArray = py::array_t<i64, py::array::c_style | py::array::forcecast>;
using WeightArray = py::array_t<double, py::array::c_style | py::array::forcecast>;

namespace {

// Max segment tree over bin capacities; leaf b holds the remaining room of bin b.
class CapacityTree {
 public:
  CapacityTree(size_t n, i64 budget) {
    size_ = 1;
    while (size_ < std::max<size_t>(n, 1)) size_ <<= 1;
    tree_.assign(2 * size_, budget);
  }
  // Leftmost leaf whose value is >= need; the caller guarantees one exists (an unopened bin).
  size_t first_fit(i64 need) const {
    size_t node = 1;
    while (node < size_) node = tree_[2 * node] >= need ? 2 * node : 2 * node + 1;
    return node - size_;
  }
  i64 get(size_t leaf) const { return tree_[size_ + leaf]; }
  void set(size_t leaf, i64 value) {
    size_t node = size_ + leaf;
    tree_[node] = value;
    for (node >>= 1; node >= 1; node >>= 1) tree_[node] = std::max(tree_[2 * node], tree_[2 * node + 1]);
  }

 private:
  size_t size_;
  std::vector<i64> tree_;
};

std::vector<std::vector<i64>> pack_ffd(LenArray lengths_arr, i64 max_tokens, bool allow_oversize) {
  if (max_tokens < 1) throw std::invalid_argument("max_tokens must be >= 1");
  const i64 n = static_cast<i64>(lengths_arr.size());
  const i64* len = lengths_arr.data();
  std::vector<i64> order(n);
  std::iota(order.begin(), order.end(), 0);
  // Longest first; equal lengths keep index order so the Python twin's sort gives the same order.
  std::stable_sort(order.begin(), order.end(), [&](i64 a, i64 b) { return len[a] > len[b]; });

  std::vector<std::vector<i64>> bins;
  CapacityTree tree(static_cast<size_t>(n), max_tokens);
  py::gil_scoped_release release;
  for (i64 idx : order) {
    const i64 L = len[idx];
    if (L < 0) throw std::invalid_argument("lengths must be non-negative");
    if (L > max_tokens) {
      if (!allow_oversize)
        throw std::invalid_argument("sequence " + std::to_string(idx) + " has length " + std::to_string(L) +
                                    " > max_tokens=" + std::to_string(max_tokens));
      // An oversize sequence gets a bin of its own that nothing else may join (room -1).
      tree.set(bins.size(), -1);
      bins.push_back({idx});
      continue;
    }
    const size_t b = tree.first_fit(L);
    if (b == bins.size()) bins.emplace_back();
    bins[b].push_back(idx);
    tree.set(b, tree.get(b) - L);
  }
  return bins;
}

// Stable insertion sort of subset positions by load: k is small (ranks, micro-batches), and
// std::stable_sort would allocate a buffer on each of the n - 1 merges.
template <class Less>
void stable_order(std::vector<size_t>& idx, Less less) {
  std::iota(idx.begin(), idx.end(), 0);
  for (size_t i = 1; i < idx.size(); ++i) {
    const size_t v = idx[i];
    size_t j = i;
    for (; j > 0 && less(v, idx[j - 1]); --j) idx[j] = idx[j - 1];
    idx[j] = v;
  }
}

struct HeapEntry {
  double spread;
  i64 id;  // creation order: ties pop oldest first, as in the Python twin's heap key
};
struct HeapLess {
  bool operator()(const HeapEntry& a, const HeapEntry& b) const {
    if (a.spread != b.spread) return a.spread < b.spread;
    return a.id > b.id;
  }
};

// Partial solutions ("states") live in flat arrays: state s has k subsets with load
// sums[s*k + j] and members in a singly linked list over items (head/tail, next[item]), so a
// merge concatenates lists in O(1) and allocates nothing. Item ids >= n are equal-size dummies.
std::vector<std::vector<i64>> balance_kk(WeightArray weights_arr, i64 k_in, bool equal_size) {
  if (k_in < 1) throw std::invalid_argument("k must be >= 1");
  const size_t k = static_cast<size_t>(k_in);
  const i64 n = static_cast<i64>(weights_arr.size());
  const double* w = weights_arr.data();
  std::vector<std::vector<i64>> out(k);
  if (n == 0) return out;
  py::gil_scoped_release release;

  // Pad with zero-weight dummies to a multiple of k; sorting by (weight, index) with dummy
  // indices below every real one puts them in the first group, one per subset, so the final
  // sizes differ by at most one (the Python twin uses indices -1, -2, ... to the same effect).
  const i64 pad = equal_size ? static_cast<i64>((k - n % k) % k) : 0;
  const i64 items = n + pad;
  const size_t n_init = equal_size ? static_cast<size_t>(items) / k : static_cast<size_t>(n);
  const size_t n_states = 2 * n_init - 1;
  std::vector<double> sums(n_states * k, 0.0);
  std::vector<i64> head(n_states * k, -1), tail(n_states * k, -1), next(items, -1);
  auto spread = [&](size_t s) {
    auto mm = std::minmax_element(sums.begin() + s * k, sums.begin() + (s + 1) * k);
    return *mm.second - *mm.first;
  };
  if (equal_size) {
    std::vector<std::pair<double, i64>> order;  // (weight, sort key); dummies sort first
    order.reserve(items);
    for (i64 d = 0; d < pad; ++d) order.emplace_back(0.0, -1 - d);
    for (i64 i = 0; i < n; ++i) order.emplace_back(w[i], i);
    std::sort(order.begin(), order.end());
    for (size_t g = 0; g < n_init; ++g)
      for (size_t j = 0; j < k; ++j) {
        const auto& it = order[g * k + j];
        const i64 item = it.second >= 0 ? it.second : n + (-1 - it.second);
        sums[g * k + j] = it.first;
        head[g * k + j] = tail[g * k + j] = item;
      }
  } else {
    for (i64 i = 0; i < n; ++i) {
      sums[i * k] = w[i];
      head[i * k] = tail[i * k] = i;
    }
  }
  std::priority_queue<HeapEntry, std::vector<HeapEntry>, HeapLess> heap;
  for (size_t s = 0; s < n_init; ++s) heap.push({spread(s), static_cast<i64>(s)});
  std::vector<size_t> ia(k), ib(k);
  size_t next_state = n_init;
  while (heap.size() > 1) {
    const size_t a = static_cast<size_t>(heap.top().id);
    heap.pop();
    const size_t b = static_cast<size_t>(heap.top().id);
    heap.pop();
    // Largest subset of a joins the smallest of b: the new spread <= max(spread a, spread b).
    stable_order(ia, [&](size_t x, size_t y) { return sums[a * k + x] > sums[a * k + y]; });
    stable_order(ib, [&](size_t x, size_t y) { return sums[b * k + x] < sums[b * k + y]; });
    const size_t m = next_state++;
    for (size_t j = 0; j < k; ++j) {
      const size_t x = a * k + ia[j], y = b * k + ib[j], z = m * k + j;
      sums[z] = sums[x] + sums[y];
      if (head[x] < 0) {
        head[z] = head[y], tail[z] = tail[y];
      } else if (head[y] < 0) {
        head[z] = head[x], tail[z] = tail[x];
      } else {
        next[tail[x]] = head[y];
        head[z] = head[x], tail[z] = tail[y];
      }
    }
    heap.push({spread(m), static_cast<i64>(m)});  // state ids double as creation order
  }
  const size_t last = static_cast<size_t>(heap.top().id);
  for (size_t j = 0; j < k; ++j) {
    for (i64 it = head[last * k + j]; it >= 0; it = next[it])
      if (it < n) out[j].push_back(it);  // drop the equal-size dummies
    std::sort(out[j].begin(), out[j].end());
  }
  return out;
}

py::array_t<int32_t> cu_seqlens(LenArray lengths_arr) {
  const i64 n = static_cast<i64>(lengths_arr.size());
  const i64* len = lengths_arr.data();
  py::array_t<int32_t> out(n + 1);
  int32_t* o = out.mutable_data();
  i64 acc = 0;
  o[0] = 0;
  for (i64 i = 0; i < n; ++i) {
    if (len[i] < 0) throw std::invalid_argument("lengths must be non-negative");
    acc += len[i];
    // flash-attn takes int32 offsets: a micro-batch past 2^31 - 1 tokens cannot be described.
    if (acc > INT32_MAX) throw std::invalid_argument("total length exceeds int32 range of cu_seqlens");
    o[i + 1] = static_cast<int32_t>(acc);
  }
  return out;
}

py::array_t<i64> position_ids(LenArray lengths_arr) {
  const i64 n = static_cast<i64>(lengths_arr.size());
  const i64* len = lengths_arr.data();
  i64 total = 0;
  for (i64 i = 0; i < n; ++i) {
    if (len[i] < 0) throw std::invalid_argument("lengths must be non-negative");
    total += len[i];
  }
  py::array_t<i64> out(total);
  i64* o = out.mutable_data();
  for (i64 i = 0, t = 0; i < n; ++i)
    for (i64 p = 0; p < len[i]; ++p) o[t++] = p;
  return out;
}

}  // namespace

void register_packing(py::module_& m) {
  m.attr("ABI_VERSION") = 2;
  m.def("pack_ffd", &pack_ffd, py::arg("lengths"), py::arg("max_tokens"), py::arg("allow_oversize") = false,
        "First-fit-decreasing packing of int64 lengths into bins of max_tokens; indices per bin.");
  m.def("balance_kk", &balance_kk, py::arg("weights"), py::arg("k"), py::arg("equal_size") = false,
        "Karmarkar-Karp k-way largest differencing over float64 weights; sorted indices per part.");
  m.def("cu_seqlens", &cu_seqlens, py::arg("lengths"), "int32 [n+1] prefix sums of lengths.");
  m.def("position_ids", &position_ids, py::arg("lengths"), "int64 positions restarting at 0 per sequence.");
}
