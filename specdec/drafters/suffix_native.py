"""The suffix tries of suffix.py in C++, and the SuffixDrafter that runs on them (``NativeSuffixDrafter``).

Each round the drafter works between two forward passes of the target, which stream its weights through
the caches: whatever the tries touch then comes from memory. The Python tries' nodes are dicts of
objects; here nodes live in one array of 64-byte nodes (ids, a free list for removed ones), each with up
to three children inline as {token, child, insertion number} and more in an open-addressing table, a
child an int64 (a node id, or a negative leaf code), and the sequences' tokens are held natively. A
round crosses into C++ once per row to grow the tries (``grow``: the request's trie and its output in
the global one) and once to draft (``draft``: the same growth, then the candidate loop of
``SuffixDrafter._best_match``), both plain CPython calls (pybind11's dispatch, which the other
methods use, costs more than the work when its data is out of the caches); trees are built
natively from the winning position (``Trie.tree``).

The Python classes stay the reference: drafts, scores, trees and counts are the same, tie-breaking
included (tests/test_suffix_native.py compares them step by step). ``suffix_drafter(...)`` (what the
engine's drafter builder calls) gives a ``NativeSuffixDrafter`` when the extension builds here
(``native.build``: pybind11, once per machine into specdec's cache folder; plain C++17, no CPU-specific
flags) and ``SPECDEC_NO_NATIVE_SUFFIX`` is unset or 0; otherwise the Python ``SuffixDrafter`` (a failed
build is logged once).
"""

from __future__ import annotations

import functools
import logging
import os

from specdec.drafters.suffix import Node, SuffixDrafter
from specdec.sequence import Sequence
from specdec.tree import DraftTree, TreeShape

log = logging.getLogger(__name__)

ENV = "SPECDEC_NO_NATIVE_SUFFIX"
# -ffp-contract=off: no fused multiply-adds (ARM compilers contract by default), so the path probabilities
# round as Python's do
FLAGS = ("-O2", "-ffp-contract=off")

_SOURCE = r"""
// The suffix tries of suffix.py (SuffixTrie, RequestTrie) in C++, with the same semantics, counts and
// tie-breaking (this module's docstring says why).
//
// Layout: nodes live in one array (ids, a free list for removed ones), 64 bytes each with up to three
// children inline ({token, child, insertion number}); a node with more children keeps them in an
// open-addressing table. A child is an int64: a node id (>= 0) or a leaf (< 0: -1 - (slot << 32 | end),
// the string's one occurrence, read from the sequence; extending it by a token is subtracting 1).
// Of equally frequent children the one first seen last wins: the largest insertion number (a child
// deleted and added again gets a new one; a leaf replaced by a node keeps its entry).
#include <pybind11/pybind11.h>
#include <algorithm>
#include <cstdint>
#include <limits>
#include <queue>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int INLINE = 3;
constexpr int32_t EMPTY = std::numeric_limits<int32_t>::min();
constexpr int TAIL_CHECK = 8;  // ngram.TAIL_CHECK: tokens compared to tell a grown history from a replaced one

struct Kid {
  int32_t token;
  uint32_t seq;  // insertion number within its node
  int64_t child;
};

inline bool is_leaf(int64_t c) { return c < 0; }
inline int64_t leaf_code(int64_t slot, int64_t end) { return -1 - ((slot << 32) | end); }
inline int64_t leaf_slot(int64_t c) { return (-1 - c) >> 32; }
inline int64_t leaf_end(int64_t c) { return (-1 - c) & 0xffffffffLL; }

struct alignas(64) Node {
  int32_t count;
  uint32_t nkids;
  uint32_t next_seq;
  int32_t table;  // index into Trie::tables, or -1: the children are inline
  Kid kids[INLINE];
};

struct Table {  // linear probing, capacity a power of two, at most half full
  std::vector<Kid> slots;
  int bits = 0;
};

inline uint32_t hash_of(int32_t t, int bits) {
  return static_cast<uint32_t>((static_cast<uint64_t>(static_cast<uint32_t>(t)) * 0x9E3779B97F4A7C15ULL) >> (64 - bits));
}

struct Seq {
  std::vector<int32_t> tokens;
  std::vector<std::pair<int64_t, int32_t>> open;  // (node, depth) of its repeated suffixes, deepest first
  bool growing = true;
};

// A token list from Python: a list or tuple (PySequence_Fast), read item by item.
struct Tokens {
  py::object fast;
  PyObject** items;
  size_t n;
  explicit Tokens(py::handle h) {
    PyObject* f = PySequence_Fast(h.ptr(), "tokens must be a sequence");
    if (f == nullptr) throw py::error_already_set();
    fast = py::reinterpret_steal<py::object>(f);
    items = PySequence_Fast_ITEMS(f);
    n = static_cast<size_t>(PySequence_Fast_GET_SIZE(f));
  }
  int32_t operator[](size_t i) const {
    long v = PyLong_AsLong(items[i]);
    if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (v <= EMPTY || v > std::numeric_limits<int32_t>::max()) throw py::value_error("token out of int32 range");
    return static_cast<int32_t>(v);
  }
};

struct Draft {
  std::vector<int32_t> tokens;
  double score = 0.0;
};

class Trie {
 public:
  explicit Trie(int depth) : depth_(depth) {
    if (depth < 1) throw py::value_error("depth must be >= 1");
    nodes_.reserve(64);
    nodes_.push_back(blank(0));  // the root
  }
  virtual ~Trie() = default;

  int depth() const { return depth_; }

  // -- sequences ----------------------------------------------------------------------------------

  int64_t add() {
    int64_t slot = next_slot_++;
    seqs_.emplace(slot, Seq());
    order_.insert(slot);
    return slot;
  }

  void push(int64_t slot, int32_t t) {  // append a token to a growing sequence and insert its occurrences
    Seq& s = grow_seq(slot);
    s.tokens.push_back(t);
    append(slot, s, s.tokens.size() - 1);
  }

  void finish(int64_t slot) {
    auto it = seqs_.find(slot);
    if (it != seqs_.end()) {
      it->second.growing = false;
      std::vector<std::pair<int64_t, int32_t>>().swap(it->second.open);
    }
  }

  int64_t insert(py::handle tokens) {
    Tokens h(tokens);
    int64_t slot = add();
    Seq& s = seqs_.at(slot);
    s.tokens.reserve(h.n);
    for (size_t j = 0; j < h.n; ++j) {
      s.tokens.push_back(h[j]);
      append(slot, s, j);
    }
    finish(slot);
    return slot;
  }

  void remove(int64_t slot) {
    auto it = seqs_.find(slot);
    if (it == seqs_.end()) throw py::key_error(std::to_string(slot));
    const std::vector<int32_t>& tokens = it->second.tokens;
    const size_t n = tokens.size();
    for (size_t i = 0; i < n; ++i) {
      int64_t node = 0;
      const size_t stop = std::min<size_t>(depth_, n - i);
      for (size_t d = 0; d < stop; ++d) {
        const int32_t t = tokens[i + d];
        Kid* k = find(node, t);
        const int64_t child = k->child;
        if (is_leaf(child) || nodes_[child].count == 1) {  // this occurrence was the only one
          remove_kid(node, t);
          if (!is_leaf(child)) free_subtree(child);
          break;
        }
        nodes_[child].count -= 1;
        node = child;
      }
    }
    seqs_.erase(it);
    order_.erase(slot);
  }

  bool has(int64_t slot) const { return seqs_.count(slot) != 0; }
  size_t num_seqs() const { return seqs_.size(); }
  int64_t oldest() const {
    if (order_.empty()) throw py::key_error("no sequence");
    return *order_.begin();
  }
  size_t length(int64_t slot) const { return get(slot).tokens.size(); }
  bool growing(int64_t slot) const { return get(slot).growing; }

  py::list slots() const {
    py::list out;
    for (int64_t s : order_) out.append(s);
    return out;
  }
  py::list seq(int64_t slot) const { return to_list(get(slot).tokens); }
  py::list open(int64_t slot) const {
    py::list out;
    for (auto& [node, d] : get(slot).open) out.append(py::make_tuple(node, d));
    return out;
  }

  // -- positions ----------------------------------------------------------------------------------

  py::object walk_py(py::handle tokens, size_t start, size_t stop) const {
    Tokens h(tokens);
    if (stop > h.n || start > stop) throw py::index_error("walk: bad range");
    std::vector<int32_t> v(stop - start);
    for (size_t i = start; i < stop; ++i) v[i - start] = h[i];
    int64_t at;
    if (!walk(v.data(), 0, v.size(), &at)) return py::none();
    return py::int_(at);
  }

  size_t longest_match_py(py::handle tokens, size_t max_len) const {
    Tokens h(tokens);
    std::vector<int32_t> v(h.n);
    for (size_t i = 0; i < h.n; ++i) v[i] = h[i];
    return longest_match(v.data(), v.size(), max_len);
  }

  int32_t count(int64_t at) const { return is_leaf(at) ? 1 : nodes_[at].count; }

  // (token, child, count) of a node's children in the order they were first seen (a leaf: its one continuation)
  py::list kids(int64_t at) const {
    py::list out;
    if (is_leaf(at)) {
      const Seq& s = get(leaf_slot(at));
      const size_t e = leaf_end(at) + 1;
      if (e < s.tokens.size()) out.append(py::make_tuple(s.tokens[e], at - 1, 1));
      return out;
    }
    std::vector<Kid> v = all_kids(at);
    std::sort(v.begin(), v.end(), [](const Kid& a, const Kid& b) { return a.seq < b.seq; });
    for (const Kid& k : v) out.append(py::make_tuple(k.token, k.child, count(k.child)));
    return out;
  }

  py::tuple follow_py(int64_t at, int limit, double min_prob, bool count_ends) const {
    Draft d;
    follow(at, limit, min_prob, count_ends, &d);
    return py::make_tuple(to_list(d.tokens), d.score);
  }

  py::list continuations_py(int64_t at, bool count_ends) const {
    py::list out;
    for (auto& c : continuations(at, count_ends)) out.append(py::make_tuple(c.token, c.child, c.prob));
    return out;
  }

  // SuffixTrie.tree: (tokens, parents, scores) of the best-first tree below a position
  py::tuple tree(int64_t at, int num_nodes, int max_depth, int max_children, double min_prob, bool count_ends) const {
    struct Item {
      double p;
      int64_t tie;
      int32_t token;
      int64_t pos;
      int64_t parent;
      int depth;
    };
    auto later = [](const Item& a, const Item& b) {  // heapq's order on (-p, tie): a pops after b
      return a.p < b.p || (a.p == b.p && a.tie > b.tie);
    };
    std::priority_queue<Item, std::vector<Item>, decltype(later)> heap(later);
    int64_t tie = 0;
    auto push = [&](int64_t pos, int64_t parent, double prob, int depth) {
      std::vector<Continuation> cs = continuations(pos, count_ends);
      const size_t take = std::min<size_t>(cs.size(), std::max(max_children, 0));
      for (size_t i = 0; i < take; ++i) heap.push({prob * cs[i].prob, tie++, cs[i].token, cs[i].child, parent, depth});
    };
    py::list tokens, parents, scores;
    int64_t n = 0;
    push(at, -1, 1.0, 1);
    while (!heap.empty() && n < num_nodes) {
      Item it = heap.top();
      heap.pop();
      if (it.p < min_prob) break;
      tokens.append(it.token);
      parents.append(it.parent);
      scores.append(it.p);
      ++n;
      if (it.depth < max_depth) push(it.pos, n - 1, it.p, it.depth + 1);
    }
    return py::make_tuple(tokens, parents, scores);
  }

  size_t live_nodes() const { return nodes_.size() - free_nodes_.size(); }
  void set_seq_limit(uint32_t limit) { seq_limit_ = limit; }  // tests: renumber children sooner

  // (the rest is public to Request, which works on the global trie too)
  struct Continuation {
    int32_t token;
    int64_t child;
    double prob;
  };

  const Seq& get(int64_t slot) const {
    auto it = seqs_.find(slot);
    if (it == seqs_.end()) throw py::key_error(std::to_string(slot));
    return it->second;
  }

  Seq& grow_seq(int64_t slot) {
    auto it = seqs_.find(slot);
    if (it == seqs_.end()) throw py::key_error(std::to_string(slot));
    if (!it->second.growing) throw py::value_error("the sequence was finished");
    return it->second;
  }

  static py::list to_list(const std::vector<int32_t>& v) {
    py::list out(v.size());
    for (size_t i = 0; i < v.size(); ++i) PyList_SET_ITEM(out.ptr(), i, PyLong_FromLong(v[i]));
    return out;
  }

  // Insert the occurrences that end at s.tokens[j] (SuffixTrie.append)
  void append(int64_t slot, Seq& s, size_t j) {
    reserve_nodes(s.open.size() + 1);  // at most one new node per open suffix: no reallocation below
    const int32_t t = s.tokens[j];
    scratch_.clear();
    const size_t n_open = s.open.size();
    for (size_t i = 0; i <= n_open; ++i) {
      const int64_t node = i < n_open ? s.open[i].first : 0;
      const int32_t d = i < n_open ? s.open[i].second : 0;
      Kid* k = find(node, t);
      if (k == nullptr) {  // a new string: one occurrence, kept as a leaf
        add_kid(node, t, leaf_code(slot, static_cast<int64_t>(j)));
        continue;
      }
      int64_t child = k->child;
      if (is_leaf(child)) child = k->child = repeat(child, d + 1);  // a second occurrence: a node
      nodes_[child].count += 1;
      if (d + 1 < depth_) scratch_.emplace_back(child, d + 1);
    }
    s.open.swap(scratch_);
  }

  // The node for a string of d tokens held as a leaf until its second occurrence (not counted yet)
  int64_t repeat(int64_t leaf, int32_t d) {
    const int64_t first = leaf_slot(leaf);
    const size_t e = leaf_end(leaf) + 1;
    const int64_t id = alloc_node(1);
    if (d < depth_) {
      Seq& f = seqs_.at(first);
      if (e < f.tokens.size()) {
        add_kid(id, f.tokens[e], leaf - 1);
      } else if (f.growing) {  // it ends a sequence that grows: now an open suffix of it
        auto at = std::find_if(f.open.begin(), f.open.end(), [d](auto& o) { return o.second < d; });
        f.open.insert(at, {id, d});
      }
    }
    return id;
  }

  bool walk(const int32_t* tokens, size_t start, size_t stop, int64_t* out) const {
    int64_t at = 0;
    const Seq* s = nullptr;
    int64_t s_slot = -1;
    for (size_t i = start; i < stop; ++i) {
      const int32_t t = tokens[i];
      if (is_leaf(at)) {
        if (leaf_slot(at) != s_slot) s_slot = leaf_slot(at), s = &seqs_.at(s_slot);
        const size_t e = leaf_end(at) + 1;
        if (e >= s->tokens.size() || s->tokens[e] != t) return false;
        at -= 1;
      } else {
        const Kid* k = find(at, t);
        if (k == nullptr) return false;
        at = k->child;
      }
    }
    *out = at;
    return true;
  }

  size_t longest_match(const int32_t* tokens, size_t n, size_t max_len) const {
    size_t lo = 0, hi = std::min(max_len, n);
    int64_t at;
    while (lo < hi) {
      const size_t mid = (lo + hi + 1) / 2;
      if (!walk(tokens, n - mid, n, &at)) hi = mid - 1;
      else lo = mid;
    }
    return lo;
  }

  void follow(int64_t at, int limit, double min_prob, bool count_ends, Draft* out) const {
    out->tokens.clear();
    double prob = 1.0, score = 0.0;
    const Seq* s = nullptr;
    int64_t s_slot = -1;
    while (static_cast<int>(out->tokens.size()) < limit) {
      int32_t token;
      if (is_leaf(at)) {  // a string seen once: it continues as its one occurrence does (p = 1)
        if (leaf_slot(at) != s_slot) s_slot = leaf_slot(at), s = &seqs_.at(s_slot);
        const size_t e = leaf_end(at) + 1;
        if (e >= s->tokens.size()) break;
        token = s->tokens[e];
        at -= 1;
      } else {
        const Node& n = nodes_[at];
        const Kid* best = nullptr;
        int64_t top = 0, total = 0;
        for_each_kid(n, [&](const Kid& k) {
          const int64_t c = count(k.child);
          total += c;
          if (best == nullptr || c > top || (c == top && k.seq > best->seq)) best = &k, top = c;
        });
        if (best == nullptr) break;
        prob *= static_cast<double>(top) / static_cast<double>(count_ends ? n.count : total);
        token = best->token;
        at = best->child;
      }
      if (prob < min_prob) break;
      out->tokens.push_back(token);
      score += prob;
    }
    out->score = score;
  }

  std::vector<Continuation> continuations(int64_t at, bool count_ends) const {
    std::vector<Continuation> out;
    if (is_leaf(at)) {
      const Seq& s = get(leaf_slot(at));
      const size_t e = leaf_end(at) + 1;
      if (e < s.tokens.size()) out.push_back({s.tokens[e], at - 1, 1.0});
      return out;
    }
    std::vector<Kid> v = all_kids(at);
    std::vector<std::pair<int64_t, const Kid*>> kc;
    int64_t total = 0;
    for (const Kid& k : v) {
      kc.emplace_back(count(k.child), &k);
      total += kc.back().first;
    }
    if (count_ends) total = nodes_[at].count;
    std::sort(kc.begin(), kc.end(), [](auto& a, auto& b) {
      return a.first > b.first || (a.first == b.first && a.second->seq > b.second->seq);
    });
    for (auto& [c, k] : kc) out.push_back({k->token, k->child, static_cast<double>(c) / static_cast<double>(total)});
    return out;
  }

  // -- nodes and their children -------------------------------------------------------------------

  static Node blank(int32_t count) {
    Node n;
    n.count = count;
    n.nkids = 0;
    n.next_seq = 0;
    n.table = -1;
    return n;
  }

  void reserve_nodes(size_t k) {
    if (free_nodes_.size() + (nodes_.capacity() - nodes_.size()) < k)
      nodes_.reserve(std::max(2 * nodes_.capacity(), nodes_.size() + k));
  }

  int64_t alloc_node(int32_t count) {
    if (!free_nodes_.empty()) {
      const int64_t id = free_nodes_.back();
      free_nodes_.pop_back();
      nodes_[id] = blank(count);
      return id;
    }
    nodes_.push_back(blank(count));
    return static_cast<int64_t>(nodes_.size()) - 1;
  }

  void free_subtree(int64_t id) {
    std::vector<int64_t> stack{id};
    while (!stack.empty()) {
      const int64_t n = stack.back();
      stack.pop_back();
      for_each_kid(nodes_[n], [&](const Kid& k) {
        if (!is_leaf(k.child)) stack.push_back(k.child);
      });
      if (nodes_[n].table >= 0) {
        std::vector<Kid>().swap(tables_[nodes_[n].table].slots);
        free_tables_.push_back(nodes_[n].table);
      }
      nodes_[n].table = -1;
      nodes_[n].nkids = 0;
      free_nodes_.push_back(n);
    }
  }

  template <class F>
  void for_each_kid(const Node& n, F f) const {
    if (n.table < 0) {
      for (uint32_t i = 0; i < n.nkids; ++i) f(n.kids[i]);
    } else {
      for (const Kid& k : tables_[n.table].slots)
        if (k.token != EMPTY) f(k);
    }
  }

  std::vector<Kid> all_kids(int64_t at) const {  // in no particular order
    std::vector<Kid> v;
    for_each_kid(nodes_.at(at), [&](const Kid& k) { v.push_back(k); });
    return v;
  }

  const Kid* find(int64_t id, int32_t t) const { return const_cast<Trie*>(this)->find(id, t); }

  Kid* find(int64_t id, int32_t t) {
    Node& n = nodes_[id];
    if (n.table < 0) {
      for (uint32_t i = 0; i < n.nkids; ++i)
        if (n.kids[i].token == t) return &n.kids[i];
      return nullptr;
    }
    Table& tb = tables_[n.table];
    const uint32_t mask = (1u << tb.bits) - 1;
    for (uint32_t i = hash_of(t, tb.bits);; i = (i + 1) & mask) {
      Kid& k = tb.slots[i];
      if (k.token == t) return &k;
      if (k.token == EMPTY) return nullptr;
    }
  }

  void add_kid(int64_t id, int32_t t, int64_t child) {
    Node& n = nodes_[id];
    if (n.next_seq >= seq_limit_) renumber(n);
    const Kid kid{t, n.next_seq++, child};
    if (n.table < 0 && n.nkids < INLINE) {
      n.kids[n.nkids++] = kid;
      return;
    }
    if (n.table < 0) {  // a fourth child: all of them move to a table
      int32_t ti;
      if (!free_tables_.empty()) ti = free_tables_.back(), free_tables_.pop_back();
      else ti = static_cast<int32_t>(tables_.size()), tables_.emplace_back();
      Table& tb = tables_[ti];
      tb.bits = 3;
      tb.slots.assign(size_t(1) << tb.bits, Kid{EMPTY, 0, 0});
      for (uint32_t i = 0; i < n.nkids; ++i) place(tb, n.kids[i]);
      n.table = ti;
    }
    Table& tb = tables_[n.table];
    if ((n.nkids + 1) * 2 > tb.slots.size()) {
      std::vector<Kid> old(size_t(1) << (tb.bits + 1), Kid{EMPTY, 0, 0});
      old.swap(tb.slots);
      tb.bits += 1;
      for (const Kid& k : old)
        if (k.token != EMPTY) place(tb, k);
    }
    place(tb, kid);
    n.nkids += 1;
  }

  static void place(Table& tb, const Kid& kid) {
    const uint32_t mask = (1u << tb.bits) - 1;
    uint32_t i = hash_of(kid.token, tb.bits);
    while (tb.slots[i].token != EMPTY) i = (i + 1) & mask;
    tb.slots[i] = kid;
  }

  void remove_kid(int64_t id, int32_t t) {
    Node& n = nodes_[id];
    if (n.table < 0) {  // swap-remove: the order lives in the insertion numbers
      for (uint32_t i = 0; i < n.nkids; ++i)
        if (n.kids[i].token == t) {
          n.kids[i] = n.kids[--n.nkids];
          return;
        }
      return;
    }
    Table& tb = tables_[n.table];
    const uint32_t mask = (1u << tb.bits) - 1;
    uint32_t i = hash_of(t, tb.bits);
    while (tb.slots[i].token != t) {
      if (tb.slots[i].token == EMPTY) return;
      i = (i + 1) & mask;
    }
    // backward-shift deletion: move up later entries of the run that may sit at i
    for (uint32_t j = (i + 1) & mask; tb.slots[j].token != EMPTY; j = (j + 1) & mask) {
      const uint32_t home = hash_of(tb.slots[j].token, tb.bits);
      if (((j - home) & mask) >= ((j - i) & mask)) {
        tb.slots[i] = tb.slots[j];
        i = j;
      }
    }
    tb.slots[i].token = EMPTY;
    n.nkids -= 1;
  }

  void renumber(Node& n) {  // insertion numbers 0.. in the same order
    std::vector<Kid*> ks;
    if (n.table < 0) {
      for (uint32_t i = 0; i < n.nkids; ++i) ks.push_back(&n.kids[i]);
    } else {
      for (Kid& k : tables_[n.table].slots)
        if (k.token != EMPTY) ks.push_back(&k);
    }
    std::sort(ks.begin(), ks.end(), [](Kid* a, Kid* b) { return a->seq < b->seq; });
    for (size_t i = 0; i < ks.size(); ++i) ks[i]->seq = static_cast<uint32_t>(i);
    n.next_seq = static_cast<uint32_t>(ks.size());
  }

  int depth_;
  std::vector<Node> nodes_;
  std::vector<int64_t> free_nodes_;
  std::vector<Table> tables_;
  std::vector<int32_t> free_tables_;
  std::unordered_map<int64_t, Seq> seqs_;
  std::set<int64_t> order_;  // the slots held, oldest first
  int64_t next_slot_ = 0;
  uint32_t seq_limit_ = std::numeric_limits<uint32_t>::max();
  std::vector<std::pair<int64_t, int32_t>> scratch_;
};

// RequestTrie: a request's history in slot 0, and where its output stands in the global trie
class Request : public Trie {
 public:
  Request(int depth, int64_t num_prompt) : Trie(depth), num_prompt_(num_prompt) { add(); }

  int64_t num_prompt() const { return num_prompt_; }
  py::object slot() const { return slot_ < 0 ? py::object(py::none()) : py::object(py::int_(slot_)); }
  void set_slot(py::object s) { slot_ = s.is_none() ? -1 : s.cast<int64_t>(); }
  py::list tokens() const { return to_list(seqs_.at(0).tokens); }

  bool is_prefix_of(py::handle history) const {
    Tokens h(history);
    return prefix_of(h);
  }

  // sync's step: when ``history`` grew from the inserted tokens, insert the new ones, and the new output tokens
  // into the global trie (when it holds this request's output); false, changing nothing, when it did not
  bool grow(py::handle history, Trie* cache) {
    Tokens h(history);
    if (!prefix_of(h)) return false;
    Seq& s = seqs_.at(0);
    for (size_t j = s.tokens.size(); j < h.n; ++j) {
      s.tokens.push_back(h[j]);
      append(0, s, j);
    }
    if (slot_ >= 0 && cache != nullptr) output_from(h, cache);
    return true;
  }

  // release's step: the output tokens of ``history`` that the global trie lacks
  void grow_output(py::handle history, Trie* cache) {
    Tokens h(history);
    if (slot_ >= 0) output_from(h, cache);
  }

  // SuffixDrafter._best_match: (draft, score, where); where is None or (in the global trie, position, limit)
  py::tuple best_match(Trie* cache, int want, double factor, double min_prob, bool count_ends) {
    Draft best;
    const Where w = match(cache, want, factor, min_prob, count_ends, &best);
    py::object where = py::none();
    if (w.trie >= 0) where = py::make_tuple(w.trie == 1, w.pos, w.limit);
    return py::make_tuple(to_list(best.tokens), best.score, where);
  }

  struct Where {
    int trie;  // -1: no candidate drafts anything; 0: this trie; 1: the global one
    int64_t pos;
    int limit;
  };

  Where match(Trie* cache, int want, double factor, double min_prob, bool count_ends, Draft* out) {
    const std::vector<int32_t>& history = seqs_.at(0).tokens;
    Draft& best = *out;
    best.tokens.clear();
    best.score = 0.0;
    Draft cur;
    int where_trie = -1;
    int64_t where_pos = 0;
    int where_limit = 0;
    auto limit_of = [&](int64_t m) {
      return static_cast<int>(std::min<int64_t>({want, static_cast<int64_t>(factor * m + 1e-9), depth_ - m}));
    };
    auto consider = [&](const Trie& trie, int which, int64_t at, int limit) {
      trie.follow(at, limit, min_prob, count_ends, &cur);
      if (cur.score > best.score) std::swap(best, cur), where_trie = which, where_pos = at, where_limit = limit;
    };
    for (auto& [node, m] : seqs_.at(0).open) {  // the request's own repeated suffixes, longest first
      const int limit = limit_of(m);
      if (limit > best.score) consider(*this, 0, node, limit);
    }
    if (cache != nullptr) {
      if (slot_ >= 0 && cache->get(slot_).tokens.size() >= static_cast<size_t>(depth_ - 1)) {
        // every suffix that can match lies in the output: its open suffixes in the global trie
        for (auto& [node, m] : cache->get(slot_).open) {
          const int limit = limit_of(m);
          if (limit > best.score) consider(*cache, 1, node, limit);
        }
      } else if (cache->num_seqs() != 0) {
        const size_t n = history.size();
        const size_t longest = cache->longest_match(history.data(), n, depth_ - 1);
        for (size_t m = longest; m > 0; --m) {
          const int limit = limit_of(static_cast<int64_t>(m));
          if (limit > best.score) {
            int64_t at = 0;
            cache->walk(history.data(), n - m, n, &at);
            consider(*cache, 1, at, limit);
          }
        }
      }
    }
    return {where_trie, where_pos, where_limit};
  }

 private:
  bool prefix_of(const Tokens& h) const {
    const std::vector<int32_t>& mine = seqs_.at(0).tokens;
    const size_t m = mine.size();
    if (m > h.n) return false;
    const size_t w = std::min<size_t>(m, TAIL_CHECK);
    for (size_t i = m - w; i < m; ++i) {
      long v = PyLong_AsLong(h.items[i]);
      if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
      if (v != mine[i]) return false;
    }
    return true;
  }

  void output_from(const Tokens& h, Trie* cache) {
    Seq& out = cache->grow_seq(slot_);
    for (size_t i = static_cast<size_t>(num_prompt_) + out.tokens.size(); i < h.n; ++i) {
      out.tokens.push_back(h[i]);
      cache->append(slot_, out, out.tokens.size() - 1);
    }
  }

  int64_t num_prompt_;
  int64_t slot_ = -1;
};

// The two calls of a round (per row) as plain METH_FASTCALL functions: pybind11's dispatch (argument casters,
// type lookups) costs far more than the work when its data is out of the caches, as between forward passes.
// They take exactly a Request and a Trie (or None), read from pybind11's instance layout.
PyTypeObject* request_type = nullptr;
PyTypeObject* trie_type = nullptr;

template <class T>
T* unwrap(PyObject* o, PyTypeObject* type, const char* what) {
  auto* inst = reinterpret_cast<py::detail::instance*>(o);
  if (Py_TYPE(o) != type || !inst->simple_layout || !inst->simple_holder_constructed) {
    PyErr_Format(PyExc_TypeError, "expected a %s", what);
    return nullptr;
  }
  return static_cast<T*>(inst->simple_value_holder[0]);
}

template <class F>
PyObject* guarded(F f) {
  try {
    return f();
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (py::builtin_exception& e) {
    e.set_error();
  } catch (std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

// grow(request, history, cache or None) -> bool: Request.grow
PyObject* fast_grow(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n != 3) return PyErr_Format(PyExc_TypeError, "grow takes 3 arguments");
  Request* req = unwrap<Request>(args[0], request_type, "Request");
  Trie* cache = args[2] == Py_None ? nullptr : unwrap<Trie>(args[2], trie_type, "Trie");
  if (req == nullptr || (cache == nullptr && args[2] != Py_None)) return nullptr;
  return guarded([&] { return PyBool_FromLong(req->grow(args[1], cache)); });
}

// draft(request, history, cache or None, want, factor, min_prob, count_ends) -> (draft, score) or None:
// Request.grow then Request.best_match; None (changing nothing) when the history did not grow from its tokens
PyObject* fast_draft(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n != 7) return PyErr_Format(PyExc_TypeError, "draft takes 7 arguments");
  Request* req = unwrap<Request>(args[0], request_type, "Request");
  Trie* cache = args[2] == Py_None ? nullptr : unwrap<Trie>(args[2], trie_type, "Trie");
  if (req == nullptr || (cache == nullptr && args[2] != Py_None)) return nullptr;
  const long want = PyLong_AsLong(args[3]);
  const double factor = PyFloat_AsDouble(args[4]), min_prob = PyFloat_AsDouble(args[5]);
  const int count_ends = PyObject_IsTrue(args[6]);
  if (PyErr_Occurred()) return nullptr;
  return guarded([&]() -> PyObject* {
    if (!req->grow(args[1], cache)) Py_RETURN_NONE;
    Draft d;
    req->match(cache, static_cast<int>(want), factor, min_prob, count_ends != 0, &d);
    py::tuple out = py::make_tuple(Trie::to_list(d.tokens), d.score);
    return out.release().ptr();
  });
}

PyMethodDef fast_methods[] = {
    {"grow", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_grow)), METH_FASTCALL,
     "grow(request, history, cache): Request.grow"},
    {"draft", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_draft)), METH_FASTCALL,
     "draft(request, history, cache, want, factor, min_prob, count_ends): Request.grow, then best_match's "
     "(draft, score); None when the history was replaced"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Trie>(m, "Trie")
      .def(py::init<int>())
      .def_property_readonly("depth", &Trie::depth)
      .def("add", &Trie::add)
      .def("push", &Trie::push)
      .def("finish", &Trie::finish)
      .def("insert", &Trie::insert)
      .def("remove", &Trie::remove)
      .def("has", &Trie::has)
      .def("num_seqs", &Trie::num_seqs)
      .def("oldest", &Trie::oldest)
      .def("length", &Trie::length)
      .def("is_growing", &Trie::growing)
      .def("slots", &Trie::slots)
      .def("seq", &Trie::seq)
      .def("open", &Trie::open)
      .def("walk", &Trie::walk_py)
      .def("longest_match", &Trie::longest_match_py)
      .def("count", &Trie::count)
      .def("kids", &Trie::kids)
      .def("follow", &Trie::follow_py)
      .def("continuations", &Trie::continuations_py)
      .def("tree", &Trie::tree)
      .def("live_nodes", &Trie::live_nodes)
      .def("set_seq_limit", &Trie::set_seq_limit);
  py::class_<Request, Trie>(m, "Request")
      .def(py::init<int, int64_t>())
      .def_property_readonly("num_prompt", &Request::num_prompt)
      .def_property("slot", &Request::slot, &Request::set_slot)
      .def_property_readonly("tokens", &Request::tokens)
      .def("is_prefix_of", &Request::is_prefix_of)
      .def("grow", &Request::grow, py::arg("history"), py::arg("cache").none(true))
      .def("grow_output", &Request::grow_output)
      .def("best_match", &Request::best_match, py::arg("cache").none(true), py::arg("want"), py::arg("factor"),
           py::arg("min_prob"), py::arg("count_ends"))
      .def("address", [](Request& r) { return reinterpret_cast<intptr_t>(&r); })
      .def_static("unwrapped", [](py::handle o) {  // what the fast calls read: the layout check
        Request* r = unwrap<Request>(o.ptr(), request_type, "Request");
        if (r == nullptr) throw py::error_already_set();
        return reinterpret_cast<intptr_t>(r);
      });
  trie_type = reinterpret_cast<PyTypeObject*>(m.attr("Trie").ptr());
  request_type = reinterpret_cast<PyTypeObject*>(m.attr("Request").ptr());
  for (PyMethodDef* d = fast_methods; d->ml_name != nullptr; ++d)
    m.add_object(d->ml_name, py::reinterpret_steal<py::object>(PyCFunction_NewEx(d, nullptr, m.ptr())));
}
"""


def suffix_drafter(*args, native: bool | None = None, **kwargs) -> SuffixDrafter:
    """The suffix drafter to run, on SuffixDrafter's arguments: NativeSuffixDrafter where the extension builds,
    unless ``native=False`` or SPECDEC_NO_NATIVE_SUFFIX=1 (then SuffixDrafter, the reference; also where the
    build failed); ``native=True`` requires the native one."""
    if native is not False:
        reason = unavailable_reason(check_env=native is None)
        if reason is None:
            return NativeSuffixDrafter(*args, **kwargs)
        if native:
            raise RuntimeError(f"the native suffix tries are unavailable: {reason}")
    return SuffixDrafter(*args, **kwargs)


def unavailable_reason(check_env: bool = True) -> str | None:
    """Why the native tries cannot be used (``SPECDEC_NO_NATIVE_SUFFIX`` set, when ``check_env``; the build
    failed), or None when they can."""
    if check_env and os.environ.get(ENV, "") not in ("", "0"):
        return f"{ENV} is set"
    return _load()[1]


def extension():
    """The built module (classes ``Trie`` and ``Request``); raises if it is unavailable."""
    ext, reason = _load()
    if ext is None:
        raise RuntimeError(f"the native suffix tries are unavailable: {reason}")
    return ext


@functools.cache
def _load(source: str = _SOURCE):
    """(the module, None), or (None, why not), the reason logged once."""
    try:
        ext = _build(source)
        probe = ext.Request(2, 0)  # the fast calls read pybind11's instance layout: check they read it right
        if ext.Request.unwrapped(probe) != probe.address():
            raise RuntimeError("pybind11's instance layout is not the one the fast calls read")
    except Exception as e:  # no compiler, no ninja, a read-only cache, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        reason = f"building the native suffix tries failed: {type(e).__name__}: {first}"
        log.warning("%s; suffix decoding uses the Python tries", reason)
        return None, reason
    _add_inspection(ext)
    return ext, None


def _build(source: str):
    """Compile ``source`` as the module ``specdec_suffix_native_<tag>`` (native.build: cached per machine,
    a first build announced)."""
    from specdec.models import native

    return native.build("suffix_native", source, "the suffix tries", flags=FLAGS, ldflags=(), python_module=True)


def _add_inspection(ext) -> None:
    """The Python tries' views for tests (trie_counts): ``seqs`` {slot: tokens} oldest first, and ``root``, a
    copy of the trie as suffix.Node objects with Python leaf codes (children in their insertion order)."""

    def seqs(trie) -> dict[int, list[int]]:
        return {slot: trie.seq(slot) for slot in trie.slots()}

    def root(trie) -> Node:
        def copy(pos: int) -> Node:
            node = Node(trie.count(pos))
            for t, child, _ in trie.kids(pos):
                node.children[t] = copy(child) if child >= 0 else python_leaf(child)
            return node

        return copy(0)

    ext.Trie.seqs = property(seqs)
    ext.Trie.root = property(root)


def python_leaf(code: int) -> int:
    """The Python tries' leaf code ((slot << SLOT_SHIFT) | end) of a native one (-1 - that)."""
    return -1 - code


class NativeSuffixDrafter(SuffixDrafter):
    """SuffixDrafter on the native tries: the same bookkeeping (requests, their outputs' slots in the
    global trie, eviction, release), each method mirroring the Python one it replaces; a row's round is
    one ``grow`` call (observe) and one ``draft`` call (propose)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._ext = extension()
        self.cache = self._ext.Trie(self.depth)

    def draft(self, seq: Sequence, want: int) -> tuple[list[int], float]:
        req = self.requests.get(seq.seq_id)
        if req is not None:  # the usual round: one call grows the tries and drafts
            out = self._ext.draft(req, seq.token_ids, self.cache, want, self.max_spec_factor, self.min_token_prob,
                                  self.count_ends)
            if out is not None:
                return out
        return self._draft(self.sync(seq), want)

    def sync(self, seq: Sequence):
        req = self.requests.get(seq.seq_id)
        if req is None or not self._ext.grow(req, seq.token_ids, self.cache):
            if req is not None and req.slot is not None:  # its old output leaves with its old history
                self.cache.remove(req.slot)
                del self.running[req.slot]
            req = self.requests[seq.seq_id] = self._ext.Request(self.depth, seq.num_prompt_tokens)
            if self.max_cached_requests:
                req.slot = self.cache.add()  # its output, empty until its first output token
                self.running[req.slot] = req
                self._evict(req.slot)
            self._ext.grow(req, seq.token_ids, self.cache)
        return req

    def _grow_output(self, req, history: list[int]) -> None:  # release's completion of an output
        req.grow_output(history, self.cache)

    def _has_output(self, req) -> bool:
        return self.cache.length(req.slot) > 0

    def _evict(self, keep: int) -> None:
        while self.cache.num_seqs() > self.max_cached_requests:
            slot = self.cache.oldest()
            assert slot != keep
            self.cache.remove(slot)
            req = self.running.pop(slot, None)
            if req is not None:  # a running request: its output stops joining
                req.slot = None

    def _best_match(self, req, want: int):
        draft, score, where = req.best_match(self.cache, want, self.max_spec_factor, self.min_token_prob,
                                             self.count_ends)
        if where is not None:
            in_cache, at, limit = where
            where = (self.cache if in_cache else req, at, limit)
        return draft, score, where

    def draft_tree(self, seq: Sequence, shape: TreeShape) -> tuple[DraftTree | None, float]:
        _, score, where = self._best_match(self.sync(seq), shape.max_depth)
        if where is None:
            return None, 0.0
        trie, at, limit = where
        tokens, parents, scores = trie.tree(at, shape.num_nodes, limit, shape.max_children, self.min_token_prob,
                                            self.count_ends)
        return (DraftTree(tokens, parents, None, scores) if tokens else None), score
