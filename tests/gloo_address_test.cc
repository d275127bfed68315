// The address Gloo binds to (internal::ChooseGlooAddress): loopback only
// where every peer is on this host, the address on the route to MASTER_ADDR
// otherwise, and for a host whose name maps to 127.0.1.1 in a job spanning
// hosts (the Debian default) its one interface address or an error that
// says what to set — never a silent bind to loopback.
#include "evenstep/internal/gloo_address.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <map>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace evenstep::internal {
namespace {

using ::testing::HasSubstr;

GlooAddressInputs TwoHosts() {
  GlooAddressInputs in;
  in.host = "node-b";
  in.master_addr = "node-a";
  in.world_size = 2;
  in.local_world_size = 1;
  in.interfaces = {"veth1=10.9.0.2"};
  return in;
}

TEST(GlooAddressTest, TheInterfaceNamedByGlooSocketIfnameWins) {
  GlooAddressInputs in = TwoHosts();
  in.ifname = "eth7";
  in.route_address = "10.9.0.2";
  EXPECT_EQ(*ChooseGlooAddress(in), "if:eth7");
}

TEST(GlooAddressTest, ALoopbackInterfaceIsRefusedAcrossHostsOnly) {
  GlooAddressInputs in = TwoHosts();
  in.ifname = "lo";
  in.ifname_loopback = true;
  absl::StatusOr<std::string> chosen = ChooseGlooAddress(in);
  ASSERT_FALSE(chosen.ok());
  EXPECT_THAT(chosen.status().message(),
              HasSubstr("host node-b: GLOO_SOCKET_IFNAME=lo is a loopback interface but the job "
                        "spans hosts (2 ranks, 1 on this host)"));
  in.local_world_size = 2;  // every rank on this host: loopback serves
  EXPECT_EQ(*ChooseGlooAddress(in), "if:lo");
  EXPECT_TRUE(IsLoopbackInterface("lo"));
}

TEST(GlooAddressTest, OneHostOverLoopbackBindsLoopback) {
  GlooAddressInputs in;
  in.master_addr = "127.0.0.1";
  in.world_size = in.local_world_size = 4;
  in.route_address = "127.0.0.1";
  EXPECT_EQ(*ChooseGlooAddress(in), "127.0.0.1");
  in.world_size = in.local_world_size = 1;
  in.route_address.clear();
  EXPECT_EQ(*ChooseGlooAddress(in), "127.0.0.1");
  // A host name that /etc/hosts maps to 127.0.1.1, every rank here: loopback serves.
  in.master_addr = "node-a";
  in.world_size = in.local_world_size = 2;
  in.route_address = "127.0.0.1";
  EXPECT_EQ(*ChooseGlooAddress(in), "127.0.0.1");
}

TEST(GlooAddressTest, AcrossHostsTheAddressOnTheRouteToTheMaster) {
  GlooAddressInputs in = TwoHosts();
  in.route_address = "10.9.0.2";
  EXPECT_EQ(*ChooseGlooAddress(in), "10.9.0.2");
  // The master's own host: the route to its own address leaves from it.
  in.master_addr = "10.9.0.1";
  in.route_address = "10.9.0.1";
  EXPECT_EQ(*ChooseGlooAddress(in), "10.9.0.1");
}

TEST(GlooAddressTest, AMasterNameOnLoopbackInAJobAcrossHostsTakesTheOneInterface) {
  GlooAddressInputs in = TwoHosts();
  in.host = "node-a";
  in.route_address = "127.0.0.1";  // node-a -> 127.0.1.1 in this host's /etc/hosts
  EXPECT_EQ(*ChooseGlooAddress(in), "10.9.0.2");
  in.interfaces = {"eth0=10.9.0.2", "eth0=2001:db8::2"};  // IPv4 first
  EXPECT_EQ(*ChooseGlooAddress(in), "10.9.0.2");
}

TEST(GlooAddressTest, AMasterNameOnLoopbackWithSeveralOrNoInterfacesSaysWhatToSet) {
  GlooAddressInputs in = TwoHosts();
  in.host = "node-a";
  in.route_address = "127.0.0.1";
  in.interfaces = {"eth0=10.9.0.2", "eth1=192.168.5.2"};
  absl::StatusOr<std::string> chosen = ChooseGlooAddress(in);
  ASSERT_FALSE(chosen.ok());
  EXPECT_THAT(chosen.status().message(),
              HasSubstr("host node-a: MASTER_ADDR=node-a is loopback here (127.0.0.1) but the "
                        "job spans hosts (2 ranks, 1 on this host)"));
  EXPECT_THAT(chosen.status().message(), HasSubstr("GLOO_SOCKET_IFNAME"));
  EXPECT_THAT(chosen.status().message(), HasSubstr("eth0=10.9.0.2, eth1=192.168.5.2"));
  in.interfaces.clear();
  chosen = ChooseGlooAddress(in);
  ASSERT_FALSE(chosen.ok());
  EXPECT_THAT(chosen.status().message(), HasSubstr("no non-loopback interface up"));
}

// torchrun's MASTER_ADDR is the master host's name, loopback there: with
// several interfaces, the one the ranks on other hosts reached it at; an
// address they saw that is not this host's (a NAT, another machine) is not
// taken, and the choice falls back to the rules above.
TEST(GlooAddressTest, AMasterNameOnLoopbackTakesTheAddressTheOtherHostsReachedItAt) {
  GlooAddressInputs in = TwoHosts();
  in.host = "node-a";
  in.route_address = "127.0.0.1";
  in.interfaces = {"docker0=172.17.0.1", "eth0=10.9.0.2", "eth1=192.168.5.2"};
  in.master_seen = {"10.9.0.2", "10.9.0.2"};
  EXPECT_EQ(*ChooseGlooAddress(in), "10.9.0.2");
  EXPECT_EQ(GlooWhy(in, "10.9.0.2"),
            "the address the ranks on other hosts reach MASTER_ADDR node-a at; it is loopback "
            "here");
  in.master_seen = {"203.0.113.9"};  // not an address of this host
  absl::StatusOr<std::string> chosen = ChooseGlooAddress(in);
  ASSERT_FALSE(chosen.ok());
  EXPECT_THAT(chosen.status().message(), HasSubstr("GLOO_SOCKET_IFNAME"));
  in.interfaces = {"eth0=10.9.0.2"};
  EXPECT_EQ(*ChooseGlooAddress(in), "10.9.0.2");
  EXPECT_EQ(GlooWhy(in, "10.9.0.2"),
            "the one interface address here; MASTER_ADDR node-a is loopback here");
  in.route_address = "10.9.0.2";
  EXPECT_EQ(GlooWhy(in, "10.9.0.2"), "the address that reaches MASTER_ADDR node-a");
  EXPECT_EQ(GlooWhy(in, "if:eth0"), "interface eth0 from GLOO_SOCKET_IFNAME");
  EXPECT_EQ(GlooWhy(in, ""), "the address its host name resolves to");
}

TEST(GlooAddressTest, NoRouteKeepsTheDefaultDevice) {
  GlooAddressInputs in = TwoHosts();
  in.route_error = "no route";
  EXPECT_EQ(*ChooseGlooAddress(in), "");
}

TEST(GlooAddressTest, TheRouteFromThisMachine) {
  EXPECT_EQ(*LocalAddressTowards("127.0.0.1", 29500), "127.0.0.1");
  EXPECT_FALSE(LocalAddressTowards("no-such-host.invalid", 29500).ok());
  absl::StatusOr<Route> route = RouteTowards("localhost", 29500);
  ASSERT_TRUE(route.ok()) << route.status();
  EXPECT_TRUE(IsLoopbackAddress(route->remote)) << route->remote;  // what the name resolved to
  // Each of this machine's own addresses is reached from itself.
  for (const std::string& i : UpInterfaceAddresses()) {
    const std::string address = i.substr(i.find('=') + 1);
    EXPECT_EQ(*LocalAddressTowards(address, 29500), address) << i;
    EXPECT_FALSE(IsLoopbackAddress(address)) << i;
  }
}

// The reachability check's connects, each outcome on this machine: a
// listener reached, a port nobody listens on refused (its cause said), and
// a listener whose accept queue is full (its SYNs dropped, as a firewall
// would) unanswered until the timeout.
TEST(GlooAddressTest, ConnectToEachNamesEveryTargetItCouldNotReach) {
  auto mine = ReachListener::Open("127.0.0.1");
  auto open = ReachListener::Open("127.0.0.1");
  ASSERT_TRUE(mine.ok() && open.ok());
  int closed_port = 0;
  {
    auto closed = ReachListener::Open("127.0.0.1");
    ASSERT_TRUE(closed.ok());
    closed_port = (*closed)->port();
  }
  // A listener with a backlog of 0 holds one connection; the next SYNs are
  // dropped while it is full.
  const int full = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in at{};
  at.sin_family = AF_INET;
  at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(at);
  ASSERT_EQ(bind(full, reinterpret_cast<sockaddr*>(&at), len), 0);
  ASSERT_EQ(listen(full, 0), 0);
  ASSERT_EQ(getsockname(full, reinterpret_cast<sockaddr*>(&at), &len), 0);
  const int full_port = ntohs(at.sin_port);
  std::vector<int> fillers;
  for (int i = 0; i < 4; ++i) {  // more than the queue holds: it is full
    const int f = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    connect(f, reinterpret_cast<sockaddr*>(&at), len);
    fillers.push_back(f);
  }
  const std::vector<ReachFailure> failures = ConnectToEach({{1, "127.0.0.1", (*open)->port()},
                                                            {2, "127.0.0.1", closed_port},
                                                            {3, "127.0.0.1", full_port},
                                                            {4, "not-an-address", 1}},
                                                           **mine, absl::Milliseconds(1500));
  for (int f : fillers) close(f);
  close(full);
  ASSERT_EQ(failures.size(), 3u);
  std::map<int, ReachFailure> by_rank;
  for (const ReachFailure& f : failures) by_rank[f.rank] = f;
  EXPECT_EQ(by_rank.count(1), 0u);
  EXPECT_EQ(by_rank[2].reason, "Connection refused");
  EXPECT_THAT(by_rank[2].cause, HasSubstr("nothing listens there"));
  EXPECT_EQ(by_rank[3].reason, "no answer within 1.5s");
  EXPECT_THAT(by_rank[3].cause, HasSubstr("dropped on the way"));
  EXPECT_THAT(by_rank[4].reason, HasSubstr("'not-an-address' is not a numeric address"));
}

TEST(GlooAddressTest, TheBindAddressOfEachDeviceSpec) {
  EXPECT_EQ(*GlooBindAddress("10.1.2.3"), "10.1.2.3");
  EXPECT_EQ(*GlooBindAddress("if:lo"), "127.0.0.1");
  EXPECT_THAT(std::string(GlooBindAddress("if:no-such-if0").status().message()),
              HasSubstr("GLOO_SOCKET_IFNAME=no-such-if0 is not an interface that is up"));
  EXPECT_TRUE(GlooBindAddress("").ok());  // the host name's address
}

}  // namespace
}  // namespace evenstep::internal
