// Work plan of the C++ paged attention: which query rows meet which fixed key chunk.
//
// Keys are cut into chunks of `chunk_pages` pages from position 0. A sequence's query rows are
// cut into row blocks of at most kRowBlock positions. An item is one chunk for one or more row
// blocks whose pages in that chunk are the same block ids (a shared prefix): its thread reads
// those pages once for all of them. Items are built once per step and reused by every layer
// (one plan per attention window).
//
// A window W > 0 (sliding-window attention: the row at position p sees keys p - W < k <= p)
// starts a row block's keys at lo = max(0, p0 - W + 1) of its first row: its items begin with
// the chunk holding lo, and an item's pages with the page holding lo (`item_first_page` in
// attention.cpp; the key of an item carries that page, so entries sharing an item share it),
// so pages wholly before the window are never read. A token has partials only for the chunks
// from its own lo's chunk to its position's: chunk_off[t] is the partial of chunk
// first_chunk(t).
#include <algorithm>
#include <array>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "ops.h"

namespace kvr {

namespace {

constexpr int kRowBlock = 16;  // query positions per row block
// Cap on positions sharing one item. A prefill chunk's item re-lays its chunk's V once per KV
// head (bf16 path) and reads its pages once for all its rows: 64 positions instead of 16 took
// the bf16 attention of a 512-row chunk at 4,096 tokens from 10.5 to 8.2 ms per layer (fp32,
// 2,048 context: 18.3 -> 16.9 ms); decode items (one position per sequence) do not change.
constexpr int kItemPositions = 64;

struct Item {
  int chunk;
  int positions = 0;
  int pages = 0;
  std::vector<std::array<int, 4>> entries;  // seq, first token, positions, first position
};

void fail(const std::string& msg) { throw std::invalid_argument(msg); }

}  // namespace

PlanOut build_plan(const int* tables, int num_seqs, int width, const int* ctx, const int* qsl,
                   int num_tokens, int page_size, int chunk_pages, int64_t num_blocks,
                   int window) {
  if (window < 0) fail("window must be >= 0");
  if (qsl[0] != 0 || qsl[num_seqs] != num_tokens)
    fail("query_start_loc must run from 0 to " + std::to_string(num_tokens));
  const int chunk_keys = page_size * chunk_pages;
  PlanOut out;
  out.positions.resize(num_tokens);
  out.chunk_off.resize(num_tokens + 1);
  int* pos_of = out.positions.data();
  int* off_of = out.chunk_off.data();
  std::vector<Item> items;
  std::map<std::vector<int>, int> open;  // (chunk, block ids...) -> item still taking rows
  std::vector<int> key;
  int total = 0;
  for (int i = 0; i < num_seqs; ++i) {
    const int n = qsl[i + 1] - qsl[i], len = ctx[i];
    if (n < 0 || n > len)
      fail("sequence " + std::to_string(i) + ": " + std::to_string(n) +
           " query rows but context length " + std::to_string(len));
    const int num_pages = (len + page_size - 1) / page_size;
    if (num_pages > width)
      fail("sequence " + std::to_string(i) + ": context " + std::to_string(len) +
           " exceeds its block table");
    const int* table = tables + (int64_t)i * width;
    for (int p = 0; p < num_pages; ++p)
      if (table[p] < 0 || table[p] >= num_blocks)
        fail("sequence " + std::to_string(i) + ": block id " + std::to_string(table[p]) +
             " outside the pool of " + std::to_string(num_blocks));
    for (int j0 = 0; j0 < n; j0 += kRowBlock) {
      const int npos = std::min(kRowBlock, n - j0), t0 = qsl[i] + j0, p0 = len - n + j0;
      const int plast = p0 + npos - 1;
      for (int j = 0; j < npos; ++j) {
        const int pos = p0 + j;
        pos_of[t0 + j] = pos;
        off_of[t0 + j] = total;
        total += pos / chunk_keys - window_lo(pos, window) / chunk_keys + 1;
      }
      const int lo = window_lo(p0, window);
      for (int c = lo / chunk_keys; c <= plast / chunk_keys; ++c) {
        const int first = std::max(c * chunk_pages, lo / page_size);
        const int last = std::min<int>(plast / page_size, c * chunk_pages + chunk_pages - 1);
        key.assign({c, first});
        key.insert(key.end(), table + first, table + last + 1);
        auto it = open.find(key);
        if (it == open.end() || items[it->second].positions + npos > kItemPositions) {
          items.push_back(Item{c});
          open[key] = (int)items.size() - 1;
          it = open.find(key);
        }
        Item& item = items[it->second];
        item.positions += npos;
        item.pages = last - first + 1;  // the same for every entry (the key holds them)
        item.entries.push_back({i, t0, npos, p0});
      }
    }
  }
  off_of[num_tokens] = total;
  // Costliest items first, so the dynamic queue ends with small ones (results do not depend
  // on which thread runs which item).
  std::vector<int> order(items.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = (int)k;
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    const Item &x = items[a], &y = items[b];
    return (int64_t)x.positions * x.pages > (int64_t)y.positions * y.pages;
  });
  size_t num_entries = 0;
  for (auto& it : items) num_entries += it.entries.size();
  out.items.resize(3 * items.size());
  out.entries.resize(4 * num_entries);
  int* it_out = out.items.data();
  int* en_out = out.entries.data();
  int e = 0;
  for (size_t k = 0; k < order.size(); ++k) {
    const Item& item = items[order[k]];
    it_out[3 * k] = item.chunk;
    it_out[3 * k + 1] = e;
    for (auto& en : item.entries) std::copy(en.begin(), en.end(), en_out + 4 * e++);
    it_out[3 * k + 2] = e;
  }
  return out;
}

}  // namespace kvr
