package idemgin_test

import (
	"bufio"
	"database/sql"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"github.com/gin-gonic/gin"
	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem/idemhttp"
)

// naiveWriter is the gin.ResponseWriter an obvious adapter puts around the
// middleware's ResponseWriter so that gin's handlers write to it.
type naiveWriter struct {
	http.ResponseWriter
	status, size int
}

func (w *naiveWriter) WriteHeader(code int) { w.status = code; w.ResponseWriter.WriteHeader(code) }
func (w *naiveWriter) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	n, err := w.ResponseWriter.Write(p)
	w.size += n
	return n, err
}
func (w *naiveWriter) WriteString(s string) (int, error) { return w.Write([]byte(s)) }
func (w *naiveWriter) Status() int                       { return max(w.status, http.StatusOK) }
func (w *naiveWriter) Size() int                         { return w.size }
func (w *naiveWriter) Written() bool                     { return w.status != 0 }
func (w *naiveWriter) WriteHeaderNow()                   {}
func (w *naiveWriter) Pusher() http.Pusher               { return nil }
func (w *naiveWriter) Flush()                            {}
func (w *naiveWriter) CloseNotify() <-chan bool          { return make(chan bool) }
func (w *naiveWriter) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	return nil, nil, errors.New("no hijack")
}

// naive is the obvious gin adapter of issue 14: an http.HandlerFunc that
// calls c.Next() inside the middleware. When the transaction is retried,
// the closure runs again and c.Next() does nothing the second time.
func naive(mw func(http.Handler) http.Handler) gin.HandlerFunc {
	return func(c *gin.Context) {
		orig := c.Writer
		mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			c.Request = r
			c.Writer = &naiveWriter{ResponseWriter: w}
			c.Next()
		})).ServeHTTP(orig, c.Request)
		c.Writer = orig
		c.Abort()
	}
}

// retryOnce is a gin handler that makes an order on the request's
// transaction and, on its first run, asks for the transaction to be retried,
// as a handler does after a deadlock.
func retryOnce(runs *atomic.Int32) gin.HandlerFunc {
	return func(c *gin.Context) {
		n := runs.Add(1)
		tx, ok := idemhttp.Tx[*sql.Tx](c.Request.Context())
		if !ok {
			c.String(http.StatusInternalServerError, "no tx")
			return
		}
		if _, err := tx.ExecContext(c.Request.Context(), `INSERT INTO orders (n) VALUES (?)`, n); err != nil {
			c.String(http.StatusInternalServerError, "insert: %v", err)
			return
		}
		if n == 1 && idemhttp.RetryTransaction(c.Request.Context()) {
			return // this attempt is rolled back and run again
		}
		c.JSON(http.StatusCreated, gin.H{"order": n})
	}
}

// TestNaiveAdapterRetry is the gin hazard of issue 14 with the obvious
// adapter: the transaction is retried, the second run of the closure calls
// c.Next(), which does nothing, and the empty 200 of a handler that never
// ran used to be committed as the key's answer, replayed forever, with no
// order made. The middleware now refuses to store a response the handler
// never wrote: nothing is stored, the client gets a 500, and its retry with
// the same key makes the order once.
func TestNaiveAdapterRetry(t *testing.T) {
	gin.SetMode(gin.TestMode)
	store, db := newStore(t)
	_, err := db.Exec(`CREATE TABLE orders (n INTEGER NOT NULL)`)
	require.NoError(t, err)
	var runs atomic.Int32
	engine := gin.New()
	mw, err := idemhttp.New(store, nil)
	require.NoError(t, err)
	engine.Use(naive(mw.Wrap))
	engine.POST("/orders", retryOnce(&runs))
	srv := httptest.NewServer(engine)
	defer srv.Close()

	const key = "gin-naive-retry-0001"
	first := post(t, srv, "/orders", key, `{"amount":1}`)
	require.NotEqual(t, http.StatusOK, first.status, "the empty answer of a handler that never ran was sent: %q", first.body)
	require.Equal(t, 0, records(t, db), "a response the handler never wrote was stored")
	require.Equal(t, 0, orders(t, db))

	retry := post(t, srv, "/orders", key, `{"amount":1}`)
	require.Equal(t, http.StatusCreated, retry.status, retry.body)
	require.False(t, retry.replayed)
	require.Equal(t, 1, orders(t, db))
	again := post(t, srv, "/orders", key, `{"amount":1}`)
	require.Equal(t, http.StatusCreated, again.status)
	require.True(t, again.replayed)
	require.Equal(t, retry.body, again.body)
	require.Equal(t, 1, orders(t, db))
}
