package idem

import (
	"container/list"
	"errors"
	"net/http"
	"sync"
	"time"
)

// ReplayCacheConfig configures the in-process cache of completed responses
// that [Store.Do] answers replays from without a database read (see
// Config.ReplayCache). A zero field takes its default.
//
// The cache sees only what this Store does. A record deleted by another
// process (Store.Delete or PurgeScope on another instance, the idem CLI,
// a DELETE in SQL) is still replayed from here until its entry's MaxAge
// passes; so is a record whose retention a Store with a longer MaxAge
// would outlive. Delete and PurgeScope on this Store forget the entries
// they delete. The cache never answers anything but a replay of the same
// fingerprint: a new key, a mismatch and a record in progress all go to
// the database, which decides as it would without the cache.
type ReplayCacheConfig struct {
	// MaxEntries bounds the number of cached responses; the least
	// recently used go first. Default 10 000.
	MaxEntries int
	// MaxBytes bounds the responses' bodies and headers, summed. A
	// response larger than a sixteenth of it is not cached. Default 32 MiB.
	MaxBytes int64
	// MaxAge is how long an entry answers after the response was
	// completed (or read): it must not exceed Config.Retention, so an entry
	// never outlives its record's retention deadline. Default 1 minute, or
	// Config.Retention if that is shorter. It is counted on Config.Now
	// when that is set, on the process's clock otherwise.
	MaxAge time.Duration
}

const (
	defaultReplayCacheEntries = 10_000
	defaultReplayCacheBytes   = 32 << 20
	defaultReplayCacheAge     = time.Minute
)

func (c *ReplayCacheConfig) withDefaults(retention time.Duration) *ReplayCacheConfig {
	out := *c
	if out.MaxEntries == 0 {
		out.MaxEntries = defaultReplayCacheEntries
	}
	if out.MaxBytes == 0 {
		out.MaxBytes = defaultReplayCacheBytes
	}
	if out.MaxAge == 0 {
		out.MaxAge = min(defaultReplayCacheAge, retention)
	}
	return &out
}

func (c *ReplayCacheConfig) validate(retention time.Duration) error {
	switch {
	case c.MaxEntries < 0:
		return errors.New("idem: Config.ReplayCache.MaxEntries must not be negative")
	case c.MaxBytes < 0:
		return errors.New("idem: Config.ReplayCache.MaxBytes must not be negative")
	case c.MaxAge < 0:
		return errors.New("idem: Config.ReplayCache.MaxAge must not be negative")
	case c.MaxAge > retention:
		return errors.New("idem: Config.ReplayCache.MaxAge must not exceed Config.Retention")
	}
	return nil
}

type cacheKey struct{ scope, key string }

type cacheEntry struct {
	k        cacheKey
	rec      *Record // Fingerprint, Status, Response, Token, Attempt
	size     int64
	deadline time.Time
}

// replayCache is an LRU of completed records. Its generation counts the
// forgets: a fill computed from a read or a completion that began before a
// forget is dropped, so a Delete racing a Do cannot leave the deleted
// response cached.
type replayCache struct {
	cfg        ReplayCacheConfig
	mu         sync.Mutex
	entries    map[cacheKey]*list.Element
	lru        list.List // front: most recently used
	bytes      int64
	generation uint64
}

func newReplayCache(cfg *ReplayCacheConfig) *replayCache {
	return &replayCache{cfg: *cfg, entries: make(map[cacheKey]*list.Element)}
}

// gen is the generation a fill must present.
func (c *replayCache) gen() uint64 {
	if c == nil {
		return 0
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.generation
}

// get returns a copy of the cached record of (scope, key) if it is live and
// of fingerprint fp; nil otherwise.
func (c *replayCache) get(scope, key string, fp Fingerprint, now time.Time) *Record {
	if c == nil {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	el, ok := c.entries[cacheKey{scope, key}]
	if !ok {
		return nil
	}
	e := el.Value.(*cacheEntry)
	if !now.Before(e.deadline) {
		c.remove(el)
		return nil
	}
	if !e.rec.Fingerprint.Equal(fp) {
		return nil
	}
	c.lru.MoveToFront(el)
	out := *e.rec
	out.Response = cloneResponse(e.rec.Response)
	return &out
}

// put caches rec, completed and valid until deadline, unless a forget
// happened since generation gen or the response cannot be cached.
func (c *replayCache) put(rec *Record, gen uint64, deadline time.Time, now time.Time) {
	if c == nil || rec == nil || !rec.Status.Final() || rec.Response == nil || rec.Response.BodyRef != nil || !now.Before(deadline) {
		return
	}
	size := responseSize(rec)
	if size > c.cfg.MaxBytes/16 {
		return
	}
	stored := &Record{Scope: rec.Scope, Key: rec.Key, Fingerprint: rec.Fingerprint, Status: rec.Status,
		Token: rec.Token, Attempt: rec.Attempt, Response: cloneResponse(rec.Response)}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.generation != gen {
		return
	}
	k := cacheKey{rec.Scope, rec.Key}
	if el, ok := c.entries[k]; ok {
		c.remove(el)
	}
	c.entries[k] = c.lru.PushFront(&cacheEntry{k: k, rec: stored, size: size, deadline: deadline})
	c.bytes += size
	for len(c.entries) > c.cfg.MaxEntries || c.bytes > c.cfg.MaxBytes {
		c.remove(c.lru.Back())
	}
}

// forget drops the entry of (scope, key), or every entry of scope when
// wholeScope, and moves the generation on.
func (c *replayCache) forget(scope, key string, wholeScope bool) {
	if c == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.generation++
	if !wholeScope {
		if el, ok := c.entries[cacheKey{scope, key}]; ok {
			c.remove(el)
		}
		return
	}
	for k, el := range c.entries {
		if k.scope == scope {
			c.remove(el)
		}
	}
}

func (c *replayCache) remove(el *list.Element) {
	e := el.Value.(*cacheEntry)
	c.lru.Remove(el)
	delete(c.entries, e.k)
	c.bytes -= e.size
}

// responseSize approximates what an entry holds: the body, the headers,
// the key, and a fixed overhead for the structures.
func responseSize(rec *Record) int64 {
	n := int64(len(rec.Response.Body) + len(rec.Scope) + len(rec.Key) + 256)
	for name, vs := range rec.Response.Header {
		n += int64(len(name))
		for _, v := range vs {
			n += int64(len(v) + 16)
		}
	}
	return n
}

// cloneResponse copies r, so that neither the caller's writes to a
// response it got nor to one it completed with reach the cached one.
func cloneResponse(r *Response) *Response {
	if r == nil {
		return nil
	}
	out := *r
	out.Header = http.Header(r.Header).Clone()
	if r.Body != nil {
		out.Body = append([]byte(nil), r.Body...)
	}
	return &out
}
