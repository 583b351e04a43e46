// A franz-go (kgo) reader for tests/integration/test_kafka_endpoint.py: the Kafka endpoint and
// Apache Kafka are read with it, and what it prints is compared.
//
//	franzgo partitions BOOTSTRAP TOPIC N   ConsumePartitions from the start of partitions 0..N-1
//	franzgo group BOOTSTRAP TOPIC GROUP    a ConsumerGroup member from the start, then a commit
//
// Both read until no record came for 3 s (read_committed), then print one JSON line per record
// ({"p","o","ts","k","v","h"}: key, value and header values base64, null for null) in
// partition-then-offset order, and a last line {"start":{..},"end":{..}} (kadm's ListStartOffsets
// and ListEndOffsets per partition) or, for a group, {"committed":{..}} (kadm's FetchOffsets
// after the commit). Exit 1 with the error on stderr on any failure.
package main

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"strconv"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
)

type row struct {
	P  int32        `json:"p"`
	O  int64        `json:"o"`
	Ts int64        `json:"ts"`
	K  *string      `json:"k"`
	V  *string      `json:"v"`
	H  [][2]*string `json:"h"`
}

func b64(b []byte) *string {
	if b == nil {
		return nil
	}
	s := base64.StdEncoding.EncodeToString(b)
	return &s
}

func die(err error) {
	fmt.Fprintln(os.Stderr, "franzgo:", err)
	os.Exit(1)
}

func readUntilIdle(cl *kgo.Client) []row {
	var rows []row
	last := time.Now()
	deadline := time.Now().Add(90 * time.Second)
	for time.Since(last) < 3*time.Second {
		if time.Now().After(deadline) {
			die(fmt.Errorf("still reading after 90 s"))
		}
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		fs := cl.PollFetches(ctx)
		cancel()
		for _, e := range fs.Errors() {
			if e.Err != context.DeadlineExceeded {
				die(fmt.Errorf("fetch %s/%d: %w", e.Topic, e.Partition, e.Err))
			}
		}
		fs.EachRecord(func(r *kgo.Record) {
			last = time.Now()
			hs := [][2]*string{}
			for _, h := range r.Headers {
				k := h.Key
				hs = append(hs, [2]*string{&k, b64(h.Value)})
			}
			rows = append(rows, row{r.Partition, r.Offset, r.Timestamp.UnixMilli(), b64(r.Key),
				b64(r.Value), hs})
		})
	}
	sort.Slice(rows, func(i, j int) bool {
		if rows[i].P != rows[j].P {
			return rows[i].P < rows[j].P
		}
		return rows[i].O < rows[j].O
	})
	return rows
}

func main() {
	if len(os.Args) != 5 {
		die(fmt.Errorf("usage: franzgo partitions|group BOOTSTRAP TOPIC N|GROUP"))
	}
	mode, bootstrap, topic, arg := os.Args[1], os.Args[2], os.Args[3], os.Args[4]
	opts := []kgo.Opt{kgo.SeedBrokers(bootstrap), kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart())}
	switch mode {
	case "partitions":
		n, err := strconv.Atoi(arg)
		if err != nil {
			die(err)
		}
		parts := map[int32]kgo.Offset{}
		for p := 0; p < n; p++ {
			parts[int32(p)] = kgo.NewOffset().AtStart()
		}
		opts = append(opts, kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{topic: parts}))
	case "group":
		opts = append(opts, kgo.ConsumerGroup(arg), kgo.ConsumeTopics(topic),
			kgo.DisableAutoCommit())
	default:
		die(fmt.Errorf("unknown mode %q", mode))
	}
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		die(err)
	}
	defer cl.Close()
	rows := readUntilIdle(cl)
	out := json.NewEncoder(os.Stdout)
	for _, r := range rows {
		if err := out.Encode(r); err != nil {
			die(err)
		}
	}
	adm := kadm.NewClient(cl)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if mode == "group" {
		if err := cl.CommitUncommittedOffsets(ctx); err != nil {
			die(fmt.Errorf("commit: %w", err))
		}
		got, err := adm.FetchOffsets(ctx, arg)
		if err != nil {
			die(fmt.Errorf("fetch offsets: %w", err))
		}
		committed := map[string]int64{}
		got.Each(func(o kadm.OffsetResponse) {
			if o.Err != nil {
				die(fmt.Errorf("fetch offsets %s/%d: %w", o.Topic, o.Partition, o.Err))
			}
			committed[strconv.Itoa(int(o.Partition))] = o.At
		})
		if err := out.Encode(map[string]any{"committed": committed}); err != nil {
			die(err)
		}
		return
	}
	starts, err := adm.ListStartOffsets(ctx, topic)
	if err != nil {
		die(fmt.Errorf("list start offsets: %w", err))
	}
	ends, err := adm.ListEndOffsets(ctx, topic)
	if err != nil {
		die(fmt.Errorf("list end offsets: %w", err))
	}
	flat := func(l kadm.ListedOffsets) map[string]int64 {
		m := map[string]int64{}
		l.Each(func(o kadm.ListedOffset) {
			if o.Err != nil {
				die(fmt.Errorf("list offsets %s/%d: %w", o.Topic, o.Partition, o.Err))
			}
			m[strconv.Itoa(int(o.Partition))] = o.Offset
		})
		return m
	}
	if err := out.Encode(map[string]any{"start": flat(starts), "end": flat(ends)}); err != nil {
		die(err)
	}
}
