// The Go programs of the client matrix (tests/integration/test_client_matrix.py): segmentio's
// kafka-go and IBM's sarama behind the command line and the JSON lines of
// tests/integration/clients/clientlib.py:
//
//	goclients kafka-go|sarama read    BOOTSTRAP TOPIC LASTS
//	goclients kafka-go|sarama group   BOOTSTRAP TOPIC LASTS GROUP N
//	goclients kafka-go|sarama offsets BOOTSTRAP TOPIC PARTITIONS
//	goclients kafka-go|sarama produce BOOTSTRAP TOPIC
//	goclients kafka-go|sarama idle    BOOTSTRAP TOPIC LASTS SECONDS
//
// SARAMA_VERSION (e.g. 2.0.0) pins sarama's protocol version (default: sarama's own default).
package main

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

const readTimeout = 30 * time.Second
const settle = 8 * time.Second

func b64(b []byte) *string {
	if b == nil {
		return nil
	}
	s := base64.StdEncoding.EncodeToString(b)
	return &s
}

func emit(v any) {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	os.Stdout.Write(append(b, '\n'))
}

func fail(format string, args ...any) {
	emit(map[string]string{"error": fmt.Sprintf(format, args...)})
	os.Exit(1)
}

func parseLasts(s string) []int64 {
	var out []int64
	for _, x := range strings.Split(s, ",") {
		n, err := strconv.ParseInt(x, 10, 64)
		if err != nil {
			fail("bad LASTS %q", s)
		}
		out = append(out, n)
	}
	return out
}

type header struct {
	Key   string
	Value []byte
}

type tracker struct {
	topic string
	lasts []int64
	seen  []int64
	count int
	quiet bool
}

func newTracker(topic string, lasts []int64, quiet bool) *tracker {
	seen := make([]int64, len(lasts))
	for i := range seen {
		seen[i] = -1
	}
	return &tracker{topic: topic, lasts: lasts, seen: seen, quiet: quiet}
}

func (t *tracker) add(p int, off int64, ts time.Time, key, value []byte, hs []header) {
	if off <= t.seen[p] {
		fail("partition %d: offset %d delivered again (after offset %d; %d records delivered)",
			p, off, t.seen[p], t.count)
	}
	t.seen[p] = off
	t.count++
	if t.quiet {
		return
	}
	hout := [][2]*string{}
	for _, h := range hs {
		k := h.Key
		hout = append(hout, [2]*string{&k, b64(h.Value)})
	}
	emit(map[string]any{"topic": t.topic, "partition": p, "offset": off,
		"timestamp": ts.UnixMilli(), "key": b64(key), "value": b64(value), "headers": hout})
}

func (t *tracker) done() bool {
	for p, last := range t.lasts {
		if t.seen[p] < last {
			return false
		}
	}
	return true
}

func (t *tracker) missing() string {
	var parts []string
	for p, last := range t.lasts {
		if t.seen[p] < last {
			parts = append(parts, fmt.Sprintf("partition %d at offset %d (last record %d)",
				p, t.seen[p], last))
		}
	}
	return strings.Join(parts, ", ")
}

func intKeys[V any](m map[int]V) map[string]V {
	out := map[string]V{}
	for k, v := range m {
		out[strconv.Itoa(k)] = v
	}
	return out
}

func main() {
	if len(os.Args) < 3 {
		fail("usage: goclients kafka-go|sarama COMMAND ARGS")
	}
	var c client
	switch os.Args[1] {
	case "kafka-go":
		c = kafkaGo{}
	case "sarama":
		c = newSarama()
	default:
		fail("unknown client %q", os.Args[1])
	}
	a := os.Args[3:]
	need := func(n int) {
		if len(a) != n {
			fail("%s %s takes %d arguments", os.Args[1], os.Args[2], n)
		}
	}
	switch os.Args[2] {
	case "read":
		need(3)
		c.read(a[0], a[1], parseLasts(a[2]))
	case "group":
		need(5)
		n, _ := strconv.Atoi(a[4])
		c.group(a[0], a[1], parseLasts(a[2]), a[3], n)
	case "offsets":
		need(3)
		n, _ := strconv.Atoi(a[2])
		c.offsets(a[0], a[1], n)
	case "produce":
		need(2)
		c.produce(a[0], a[1])
	case "idle":
		need(4)
		s, _ := strconv.ParseFloat(a[3], 64)
		c.idle(a[0], a[1], parseLasts(a[2]), time.Duration(s*float64(time.Second)))
	default:
		fail("unknown command %q", os.Args[2])
	}
}

type client interface {
	read(bs, topic string, lasts []int64)
	group(bs, topic string, lasts []int64, group string, n int)
	offsets(bs, topic string, partitions int)
	produce(bs, topic string)
	idle(bs, topic string, lasts []int64, d time.Duration)
}
