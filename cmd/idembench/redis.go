package main

import (
	"time"

	"github.com/redis/go-redis/v9"
)

// newRedisClient returns the go-redis client of the redis scenario: the
// client services that use the SET NX pattern run, with a pool of size
// connections, all of them dialled on first use like the SQL pools are
// before a measurement (MinIdleConns), and no retry (a failed command
// stops the run, as a failed SQL statement does).
func newRedisClient(addr string, size int) *redis.Client {
	return redis.NewClient(&redis.Options{
		Addr:            addr,
		PoolSize:        size,
		MinIdleConns:    size,
		MaxRetries:      -1,
		DialTimeout:     5 * time.Second,
		ReadTimeout:     time.Minute,
		WriteTimeout:    time.Minute,
		DisableIdentity: true, // no CLIENT SETINFO round trip per connection
	})
}
