package qemu

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"time"

	"pvbridge.io/vm-operator/internal/hypervisor"
)

// guestAgentTimeout bounds a call to the guest agent: a guest that does not answer (it boots,
// or runs no agent) must not hold up the host agent's reconcile.
const guestAgentTimeout = time.Second

// Addresses implements hypervisor.Driver: the guest agent (qemu-guest-agent, on the VM's
// virtio-serial port org.qemu.guest_agent.0) lists the guest's interfaces, and the addresses of
// the one with the VM's MAC count, link-local ones left out.
func (d *Driver) Addresses(ctx context.Context, vm hypervisor.VM) ([]string, error) {
	if d.opts.Network == "" {
		return nil, nil
	}
	v, err := d.state(vm)
	if err != nil {
		return nil, err
	}
	var ifaces []struct {
		MAC string `json:"hardware-address"`
		IPs []struct {
			Address string `json:"ip-address"`
		} `json:"ip-addresses"`
	}
	if err := guestExec(ctx, v.path(guestAgentSocket), "guest-network-get-interfaces", &ifaces); err != nil {
		return nil, fmt.Errorf("VM %s: %w", v.name, err)
	}
	var v4, v6 []string
	for _, iface := range ifaces {
		if !strings.EqualFold(iface.MAC, macFor(vm)) {
			continue
		}
		for _, ip := range iface.IPs {
			addr, err := netip.ParseAddr(ip.Address)
			switch {
			case err != nil || addr.IsLinkLocalUnicast():
			case addr.Is4():
				v4 = append(v4, addr.String())
			default:
				v6 = append(v6, addr.String())
			}
		}
	}
	if len(v4)+len(v6) == 0 {
		return nil, fmt.Errorf("VM %s: %w: no address on its NIC yet", v.name, hypervisor.ErrGuestAgent)
	}
	return append(v4, v6...), nil
}

// guestExec runs command on the guest agent at the unix socket path and decodes what it returns
// into result. The channel is a byte stream that may hold the reply to an earlier client that
// gave up: guest-sync with a new id skips what comes before its own reply. A guest that does
// not answer within guestAgentTimeout is ErrGuestAgent.
func guestExec(ctx context.Context, path, command string, result any) error {
	ctx, cancel := context.WithTimeout(ctx, guestAgentTimeout)
	defer cancel()
	var dialer net.Dialer
	conn, err := dialer.DialContext(ctx, "unix", path)
	if err != nil {
		return agentError(err)
	}
	defer conn.Close()
	if deadline, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(deadline)
	}
	type reply struct {
		Return json.RawMessage `json:"return"`
		Error  *struct {
			Desc string `json:"desc"`
		} `json:"error"`
	}
	enc, dec := json.NewEncoder(conn), json.NewDecoder(conn)
	id := time.Now().UnixNano() % (1 << 53) // new to the channel, and exact in JSON
	if err := enc.Encode(map[string]any{"execute": "guest-sync", "arguments": map[string]int64{"id": id}}); err != nil {
		return agentError(err)
	}
	for {
		var r reply
		if err := dec.Decode(&r); err != nil {
			return agentError(err)
		}
		if string(r.Return) == strconv.FormatInt(id, 10) {
			break
		}
	}
	if err := enc.Encode(map[string]string{"execute": command}); err != nil {
		return agentError(err)
	}
	var r reply
	if err := dec.Decode(&r); err != nil {
		return agentError(err)
	}
	if r.Error != nil {
		return fmt.Errorf("guest agent: %s: %s", command, r.Error.Desc)
	}
	if err := json.Unmarshal(r.Return, result); err != nil {
		return errors.Join(fmt.Errorf("guest agent: %s", command), err)
	}
	return nil
}

// agentError is err of a guest agent that does not answer.
func agentError(err error) error { return fmt.Errorf("%w: %w", hypervisor.ErrGuestAgent, err) }
