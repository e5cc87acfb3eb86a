package postgres

import (
	"fmt"
	"regexp"

	"github.com/jackc/pgx/v5"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/migrations"
)

// Option configures [New] and [Migrate]. Pass the same options to both.
type Option func(*options)

type options struct {
	schema string
	err    error
}

// schemaName is what [WithSchema] accepts: a lowercase name that means the
// same quoted or not, because goose writes the version table's name
// unquoted (and splits it at the dot).
var schemaName = regexp.MustCompile(`^[a-z_][a-z0-9_]*$`)

// maxIdentifier is PostgreSQL's identifier limit (NAMEDATALEN - 1): a longer
// name would be truncated, silently merging two schemas into one.
const maxIdentifier = 63

// WithSchema names the schema of idem's tables: the idempotency_keys table
// and, for [Migrate], its goose version table ([migrations.VersionTable]).
// Every statement then names the table as "schema"."idempotency_keys", so
// neither the connection's search_path nor a pooler that drops or shares
// session settings (PgBouncer in transaction pooling mode) can send two
// instances to two tables. Without it, the table is the one the
// connection's search_path finds, as before this option existed.
//
// schema must already exist, and be lowercase letters, digits and
// underscores, starting with a letter or underscore, at most 63 bytes;
// otherwise New returns a Dialect whose every call, and Migrate, fails with
// an error matching [idem.ErrMisconfigured].
func WithSchema(schema string) Option {
	return func(o *options) {
		if !schemaName.MatchString(schema) || len(schema) > maxIdentifier {
			o.err = fmt.Errorf("%w: idem: postgres: WithSchema(%q): want 1 to %d lowercase letters, digits and underscores, not starting with a digit",
				idem.ErrMisconfigured, schema, maxIdentifier)
			return
		}
		o.schema = schema
	}
}

func applyOptions(opts []Option) options {
	var o options
	for _, opt := range opts {
		if opt != nil {
			opt(&o)
		}
	}
	return o
}

// table returns the quoted qualified name of the table in o.schema.
func (o *options) table() string {
	return pgx.Identifier{o.schema, "idempotency_keys"}.Sanitize()
}

// versionTable returns goose's version table in o.schema, as goose takes
// it: schema.table, unquoted (WithSchema's names need no quotes).
func (o *options) versionTable() string {
	return o.schema + "." + migrations.VersionTable
}
