package cluster

import (
	"fmt"
	"net"
	"sync"
)

// ports hands out free loopback ports. A port is free when the kernel hands it out for an
// ephemeral listener; the process it is given to binds it moments later. Ports handed out by
// this lab are remembered so that two components never get the same one.
var ports struct {
	sync.Mutex
	used map[int]bool
}

func freePort() (int, error) {
	ports.Lock()
	defer ports.Unlock()
	if ports.used == nil {
		ports.used = map[int]bool{}
	}
	for range 100 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, err
		}
		port := l.Addr().(*net.TCPAddr).Port
		l.Close()
		if !ports.used[port] {
			ports.used[port] = true
			return port, nil
		}
	}
	return 0, fmt.Errorf("no free loopback port")
}

// FreePorts returns n distinct free ports of 127.0.0.1, none of them handed out before.
func FreePorts(n int) ([]int, error) {
	out := make([]int, n)
	for i := range out {
		p, err := freePort()
		if err != nil {
			return nil, err
		}
		out[i] = p
	}
	return out, nil
}
